"""The loop on one rank, over the trainer's own DeepSpeed engine (gloo, CPU): the observer, the finiteness
guard, the held and replayed step."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from vigil.events import StepCompleted, StepReplayed
from vigil.link import NullLink
from vigil.recovery import Rollback
from vigil.run import Identity, Run
from vigil.spec import JobSpec, ModelSpec, parse_spec
from vigil_trainer.context import RankContext, TrainState
from vigil_trainer.faults import FaultInjector
from vigil_trainer.loop import train
from vigil_trainer.model import GPT
from vigil_trainer.rank import RankEnv, build_engine

pytestmark = pytest.mark.usefixtures("one_rank")


def engine(spec: JobSpec) -> Any:
    """The trainer's own DeepSpeed engine (`rank.build_engine`) on this one CPU rank."""
    built, _ = build_engine(spec, RankEnv(rank=0, world=1, local_rank=0, cuda=False), torch.device("cpu"))
    return built


class Recorder:
    def __init__(self) -> None:
        self.steps: list[tuple[int, float]] = []
        self.rollbacks: list[Rollback] = []

    def on_step_end(self, step: int, seconds: float) -> None:
        self.steps.append((step, seconds))

    def on_rollback(self, timing: Rollback) -> None:
        self.rollbacks.append(timing)


def context(
    tmp_path: Path,
    steps: int,
    faults: list[dict] | None = None,
    guardian: dict | None = None,
    zero: int = 0,
) -> tuple[RankContext, Recorder]:
    spec = parse_spec(
        {
            "name": "loop",
            "resources": {"gpus_per_node": 1},
            "model": {"preset": "tiny", "n_layer": 1, "seq_len": 16},
            "train": {"steps": steps, "micro_batch": 2, "zero_stage": zero, "precision": "fp32"},
            "checkpoint": {"every": 1_000_000},
            "guardian": guardian or {},
            "faults": faults or [],
        }
    )
    torch.manual_seed(0)
    observer = Recorder()
    ctx = RankContext(
        spec=spec,
        engine=engine(spec),
        tokens=np.random.default_rng(0).integers(0, 256, 4096).astype(np.uint16),  # a steady loss
        zero_stage=zero,
        precision="fp32",
        device=torch.device("cpu"),
        faults=FaultInjector(spec.faults, 0, tmp_path / "faults"),
        run=Run(Identity("loop", 1, 0, 1, 0, "here"), NullLink(), checkpoint_root=tmp_path),
        observer=observer,
    )
    return ctx, observer


def test_the_observer_hears_one_step_end_per_step_in_order(tmp_path):
    ctx, observer = context(tmp_path, steps=4)
    st = train(ctx, TrainState())
    assert st.step == 4
    assert [s for s, _ in observer.steps] == [0, 1, 2, 3]
    assert all(seconds > 0 for _, seconds in observer.steps)
    assert observer.rollbacks == []


@pytest.mark.parametrize("zero", [0, 1])
def test_a_non_finite_step_leaves_the_weights_alone_and_training_goes_on(tmp_path, zero):
    ctx, observer = context(
        tmp_path, steps=3, faults=[{"kind": "nan", "step": 1}], guardian={"replay": False}, zero=zero
    )
    model = ctx.engine.module
    seen: dict[int, dict[str, torch.Tensor]] = {}

    def snapshot(step: int, seconds: float) -> None:
        seen[step] = {n: p.detach().clone() for n, p in model.named_parameters()}

    observer.on_step_end = snapshot  # type: ignore[method-assign]
    train(ctx, TrainState())
    assert set(seen) == {0, 1, 2}
    for name, after_0 in seen[0].items():
        assert torch.equal(seen[1][name], after_0), name  # step 1 (NaN) changed nothing
    assert any(not torch.equal(seen[2][n], seen[1][n]) for n in seen[1])  # step 2 trained again
    assert all(torch.isfinite(p).all() for p in model.parameters())


def test_configure_optimizers_decays_matrices_and_not_norms_each_parameter_once():
    model = GPT(ModelSpec(preset="tiny", n_layer=2).resolved())
    opt = model.configure_optimizers(0.1, 3e-4, betas=(0.9, 0.95))
    assert isinstance(opt, torch.optim.AdamW)
    decay, no_decay = opt.param_groups
    assert decay["weight_decay"] == 0.1 and no_decay["weight_decay"] == 0.0
    assert all(g["lr"] == 3e-4 and g["betas"] == (0.9, 0.95) for g in opt.param_groups)
    names = {id(p): n for n, p in model.named_parameters()}
    assert all(p.dim() == 2 for p in decay["params"])
    assert {names[id(p)] for p in no_decay["params"]} == {
        n for n in names.values() if n.endswith("norm.weight")
    }
    grouped = [id(p) for g in opt.param_groups for p in g["params"]]
    assert sorted(grouped) == sorted(id(p) for p in model.parameters())  # every parameter, once
    assert id(model.embed.weight) in {id(p) for p in decay["params"]}  # the tied embedding decays


class Emitted:
    """A link that keeps what the rank emits, as an agent's would (no command ever arrives)."""

    dropped = 0
    last_step: int | None = None
    latest_seq = 0

    def __init__(self) -> None:
        self.events: list = []

    def emit(self, event) -> None:  # type: ignore[no-untyped-def]
        self.events.append(event)

    def command(self, seq: int, timeout_s: float) -> None:
        raise TimeoutError("no command source")

    def arrival(self, seq: int) -> None:
        return None

    def flush(self, timeout_s: float = 30.0) -> bool:
        return True

    def close(self, timeout_s: float = 10.0) -> None:
        pass


def emitting(ctx: RankContext) -> Emitted:
    link = Emitted()
    ctx.run = Run(Identity("loop", 1, 0, 1, 0, "here"), link, checkpoint_root=ctx.run.checkpoint_root)  # type: ignore[arg-type]
    return link


def losses(link: Emitted) -> dict[int, float]:
    return {e.step: e.loss for e in link.events if isinstance(e, StepCompleted)}


@pytest.mark.parametrize("zero", [0, 1])
def test_a_transient_nan_is_replayed_in_place_and_the_run_equals_a_fault_free_one(tmp_path, zero):
    clean, _ = context(tmp_path / "clean", steps=6, zero=zero)
    clean_link = emitting(clean)
    train(clean, TrainState())
    ctx, _ = context(tmp_path / "sdc", steps=6, faults=[{"kind": "sdc", "step": 3}], zero=zero)
    link = emitting(ctx)
    st = train(ctx, TrainState())
    assert st.step == 6 and ctx.run.skip_windows == []
    assert losses(link) == losses(clean_link)  # bit for bit: the held update was never applied
    (replayed,) = [e for e in link.events if isinstance(e, StepReplayed)]
    assert (replayed.step, replayed.kind, replayed.outcome, replayed.culprits) == (3, "nan", "transient", [0])
    assert replayed.values[0].first is None and replayed.values[0].replay == losses(link)[3]
    assert not any(e.skipped for e in link.events if isinstance(e, StepCompleted))


def test_a_spike_in_the_data_is_held_and_its_window_skipped_without_a_rollback(tmp_path):
    spec = {"spike_warmup": 5, "spike_skip_steps": 2}
    ctx, _ = context(tmp_path, steps=10, faults=[{"kind": "spike", "step": 7, "factor": 20}], guardian=spec)
    link = emitting(ctx)
    model = ctx.engine.module
    st = train(ctx, TrainState())
    assert ctx.run.skip_windows == [(7, 9)] and st.step == 10
    (replayed,) = [e for e in link.events if isinstance(e, StepReplayed)]
    assert (replayed.kind, replayed.outcome, replayed.skip_data) == ("spike", "reproduced", (7, 9))
    assert replayed.values[0].first == replayed.values[0].replay  # the same data, the same spike
    steps = {e.step: e for e in link.events if isinstance(e, StepCompleted)}
    assert steps[7].data_position == 9 and steps[7].loss < replayed.values[0].first / 5
    assert sorted(steps) == list(range(10)) and all(torch.isfinite(p).all() for p in model.parameters())


def test_a_spike_is_only_reported_where_the_spec_says_alert(tmp_path):
    guardian = {"spike_warmup": 5, "spike": "alert"}
    ctx, _ = context(
        tmp_path, steps=9, faults=[{"kind": "spike", "step": 7, "factor": 20}], guardian=guardian
    )
    link = emitting(ctx)
    train(ctx, TrainState())
    assert not any(isinstance(e, StepReplayed) for e in link.events)
    assert losses(link)[7] > 5 * losses(link)[6]


def test_without_zero_the_guard_clips_with_the_norm_it_computed(tmp_path):
    """No ZeRO: DeepSpeed's gradient_clipping is 0, so the guard's one norm is also the clip's (the
    gradients come out with norm train.grad_clip, and the boundary reports the norm before clipping)."""
    from vigil_trainer import guard
    from vigil_trainer.micro import MicroSteps

    ctx, _ = context(tmp_path, steps=1)
    params = list(ctx.engine.module.parameters())
    for p in params:
        p.grad = torch.full_like(p, 3.0)
    before = torch.nn.utils.get_total_norm([p.grad for p in params]).item()
    assert before > 10 * ctx.spec.train.grad_clip
    m = MicroSteps(loss_sum=torch.tensor(2.0), count=1, finite=torch.ones(()))
    agreed = guard.agree(ctx, m)
    assert agreed.all_finite and float(m.grad_norm) == pytest.approx(before, rel=1e-6)  # type: ignore[arg-type]
    after = torch.nn.utils.get_total_norm([p.grad for p in params]).item()
    assert after == pytest.approx(ctx.spec.train.grad_clip, rel=1e-4)
