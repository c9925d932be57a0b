"""`vigil.integrations` with the real frameworks, one process, no network: a link that records what a
rank sends and hands it commands stands in for the agent. Each framework: a NaN step is skipped and
reported as this rank's, checkpoints land in Vigil's folders sealed by the manifest, a rollback stops
the Trainer and Lightning for a relaunch (which resumes from the checkpoint) and loads DeepSpeed in place."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from vigil import events as ev
from vigil import manifest
from vigil.integrations._guard import StepLoss, drop_gradients, grad_norm, verdict
from vigil.run import Identity, Restart, Run

pytestmark = pytest.mark.byo

JOB = "j"


class Recorder:
    """An agent link that keeps what the rank emits and delivers `commands` (numbered from 1); `on_step`
    may add commands when a step is reported."""

    dropped = 0
    last_step: int | None = None

    def __init__(self, on_step: Any = None) -> None:
        self.events: list[ev.Message] = []
        self.commands: list[ev.Message] = []
        self.on_step = on_step

    def emit(self, event: ev.Message) -> None:
        self.events.append(event)
        if isinstance(event, ev.StepCompleted) and self.on_step is not None:
            self.on_step(self, event.step)

    @property
    def latest_seq(self) -> int:
        return len(self.commands)

    def command(self, seq: int, timeout_s: float) -> ev.Message:
        if seq > len(self.commands):
            raise TimeoutError(f"command #{seq}")
        return self.commands[seq - 1]

    def arrival(self, seq: int) -> float | None:
        return None

    def flush(self, timeout_s: float = 30.0) -> bool:
        return True

    def close(self, timeout_s: float = 10.0) -> None:
        pass

    def of(self, cls: type[ev.Message]) -> list[Any]:
        return [e for e in self.events if isinstance(e, cls)]


def rollback_after(reported: int, to_step: int, root: Path):
    """`on_step`: once step `reported` is reported, the guardian's rollback to `to_step` arrives."""

    def on_step(link: Recorder, step: int) -> None:
        if step == reported and not link.commands:
            target = str(manifest.step_dir(root, JOB, to_step))
            link.commands.append(
                ev.RollbackJob(job_id=JOB, attempt=1, checkpoint=target, step=to_step, reason="nan")
            )

    return on_step


def a_run(root: Path, link: Recorder, resume_from: Path | None = None) -> Run:
    return Run(Identity(JOB, 1, 0, 1, 0, "n"), link, checkpoint_root=root, keep=10, resume_from=resume_from)  # type: ignore[arg-type]


def steps_reported(link: Recorder) -> list[tuple[int, bool, bool]]:
    return [(e.step, e.local_finite, e.skipped) for e in link.of(ev.StepCompleted)]


def saved(root: Path) -> list[int]:
    return [manifest.verify(path, root=root).step for _, path in manifest.checkpoints(root, JOB)]


def finite(module: nn.Module) -> bool:
    return all(bool(torch.isfinite(p).all()) for p in module.parameters())


# --- the shared guard ----------------------------------------------------------------------------------


def test_the_guard_sums_losses_on_device_and_gives_one_verdict():
    losses = StepLoss()
    assert losses.take() == (None, 0, 0)
    losses.add(torch.tensor(2.0), tokens=8)
    losses.add(torch.tensor([3.0]), tokens=8)
    total, count, tokens = losses.take()
    assert (float(total), count, tokens) == (5.0, 2, 16) and losses.take()[1] == 0
    assert verdict(None, None) is True
    assert float(verdict(torch.tensor(1.0), torch.tensor(math.inf))) == 0.0
    assert float(verdict(torch.tensor(math.nan), None)) == 0.0
    layer = nn.Linear(2, 2)
    layer(torch.ones(1, 2)).sum().backward()
    assert grad_norm(layer.parameters()) is not None
    drop_gradients(layer.parameters())
    assert grad_norm(layer.parameters()) is None


# --- Hugging Face Trainer -----------------------------------------------------------------------------


def hf_trainer(tmp: Path, run: Run, nan_at: int | None = None):
    from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainerCallback, TrainingArguments

    from vigil.integrations.hf import VigilCallback

    torch.manual_seed(0)
    config = GPT2Config(
        n_layer=1, n_embd=32, n_head=2, vocab_size=64, n_positions=16, bos_token_id=0, eos_token_id=0
    )
    model = GPT2LMHeadModel(config)
    ids = torch.randint(0, 64, (64, 16), generator=torch.Generator().manual_seed(0))
    data = [{"input_ids": row, "labels": row} for row in ids]

    class NanAt(TrainerCallback):
        step = -1

        def on_step_begin(self, args, state, control, **kwargs):
            self.step = state.global_step

    clock = NanAt()

    def poison(module, inputs, output):
        if module.training and clock.step == nan_at:
            output.loss = output.loss * float("nan")
        return output

    model.register_forward_hook(poison)
    args = TrainingArguments(
        output_dir=str(tmp / "hf"), max_steps=6, per_device_train_batch_size=4, learning_rate=1e-3,
        save_strategy="steps", save_steps=2, logging_steps=100, report_to=[], use_cpu=True, disable_tqdm=True,
    )  # fmt: skip
    return Trainer(model=model, args=args, train_dataset=data, callbacks=[clock, VigilCallback(run)]), model


def test_hf_trainer_skips_a_nan_step_adopts_checkpoints_and_resumes_after_a_rollback(tmp_path):
    from vigil.integrations.hf import resume_checkpoint

    root = tmp_path / "ckpt"
    link = Recorder(rollback_after(3, 2, root))
    trainer, model = hf_trainer(tmp_path, a_run(root, link), nan_at=2)
    with pytest.raises(Restart):
        trainer.train(resume_from_checkpoint=resume_checkpoint(a_run(root, Recorder())))
    assert steps_reported(link) == [(0, True, False), (1, True, False), (2, False, True), (3, True, False),
                                    (4, True, False)]  # fmt: skip
    assert finite(model), "the NaN step reached the weights"
    assert saved(root) == [2, 4] and [c.step for c in link.of(ev.CheckpointSaved)] == [2, 4]
    assert (manifest.step_dir(root, JOB, 4) / "trainer_state.json").is_file()
    assert not list((tmp_path / "hf").glob("checkpoint-*")), "the Trainer's folders were moved"
    (restart,) = link.of(ev.RestartRequested)
    assert restart.step == 2

    # the relaunch: VIGIL_RESUME_FROM names the checkpoint of step 4 (the newest)
    again = Recorder()
    run = a_run(root, again, resume_from=manifest.step_dir(root, JOB, 4))
    trainer, model = hf_trainer(tmp_path, run)
    trainer.train(resume_from_checkpoint=resume_checkpoint(run))
    assert [s for s, _, _ in steps_reported(again)] == [4, 5]
    assert saved(root) == [2, 4, 6]


def test_hf_trainer_reports_the_trainers_own_norm_and_clips_once(tmp_path, monkeypatch):
    """With a max_grad_norm every step exceeds, the callback reports the unclipped norm the Trainer
    computed and logs (it computes none of its own), and the weights end bit for bit where the Trainer's
    own clipping takes them without Vigil: clipped once."""
    from vigil.integrations import hf

    def no_norm_of_its_own(params: Any) -> None:
        raise AssertionError("the callback computed the norm again")

    monkeypatch.setattr(hf, "grad_norm", no_norm_of_its_own)
    from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

    from vigil.integrations.hf import VigilCallback

    def train(callbacks: list[Any]) -> tuple[nn.Module, Trainer]:
        torch.manual_seed(0)
        config = GPT2Config(
            n_layer=1, n_embd=32, n_head=2, vocab_size=64, n_positions=16, bos_token_id=0, eos_token_id=0
        )
        model = GPT2LMHeadModel(config)
        ids = torch.randint(0, 64, (16, 16), generator=torch.Generator().manual_seed(0))
        args = TrainingArguments(
            output_dir=str(tmp_path / "hf"), max_steps=3, per_device_train_batch_size=4, learning_rate=1e-2,
            max_grad_norm=0.01, save_strategy="no", logging_steps=1, report_to=[], use_cpu=True,
            disable_tqdm=True, lr_scheduler_type="constant",
        )  # fmt: skip
        data = [{"input_ids": row, "labels": row} for row in ids]
        trainer = Trainer(model=model, args=args, train_dataset=data, callbacks=callbacks)
        trainer.train()
        return model, trainer

    link = Recorder()
    with_vigil, trainer = train([VigilCallback(a_run(tmp_path / "ckpt", link))])
    alone, _ = train([])
    reported = [e.grad_norm for e in link.of(ev.StepCompleted)]
    logged = [h["grad_norm"] for h in trainer.state.log_history if "grad_norm" in h]
    assert len(reported) == 3 and all(n > 0.01 * 10 for n in reported), reported  # not the clipped norm
    assert reported == logged
    assert trainer.args.max_grad_norm == 0.01, "the Trainer's arguments are left alone"
    assert "clip_grad_norm_" not in vars(trainer.accelerator), "the norm is no longer watched"
    for mine, theirs in zip(with_vigil.parameters(), alone.parameters(), strict=True):
        assert torch.equal(mine, theirs)


def test_what_the_hf_callback_reads_of_the_trainer_exists(tmp_path):
    """`hf_compat`'s names in the installed transformers: the Trainer found from inside its callback, its
    wrapped model, and the norm its accelerator computes."""
    from transformers import TrainerCallback

    from vigil.integrations import hf_compat

    seen: dict[str, Any] = {}

    class Look(TrainerCallback):
        def on_train_begin(self, args, state, control, **kwargs):
            seen["trainer"] = hf_compat.calling_trainer()
            seen["undo"] = hf_compat.watch_grad_norm(seen["trainer"], seen.setdefault("norms", []).append)

        def on_step_begin(self, args, state, control, **kwargs):
            seen["wrapped"] = hf_compat.wrapped_model(seen["trainer"])

    from vigil.integrations.hf import VigilCallback

    trainer, _ = hf_trainer(tmp_path, a_run(tmp_path / "ckpt", Recorder()))
    trainer.remove_callback(VigilCallback)  # which watches the norm the same way
    trainer.add_callback(Look())
    trainer.train()
    assert seen["trainer"] is trainer and seen["wrapped"] is trainer.model_wrapped
    assert len(seen["norms"]) == 6 and all(torch.is_tensor(n) and n > 0 for n in seen["norms"])
    seen["undo"]()
    assert "clip_grad_norm_" not in vars(trainer.accelerator)


# --- Lightning ---------------------------------------------------------------------------------------


def lightning_trainer(tmp: Path, run: Run, nan_at: int | None = None):
    import lightning.pytorch as L

    from vigil.integrations import lightning as vigil_pl

    class Regression(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))

        def training_step(self, batch, batch_idx):
            x, y = batch
            loss = nn.functional.mse_loss(self.net(x), y)
            return loss * float("nan") if self.trainer.global_step == nan_at else loss

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-2)

    torch.manual_seed(0)
    g = torch.Generator().manual_seed(0)
    data = torch.utils.data.TensorDataset(torch.randn(48, 8, generator=g), torch.randn(48, 1, generator=g))
    trainer = L.Trainer(
        accelerator="cpu", devices=1, max_steps=6, default_root_dir=str(tmp / "pl"), logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        callbacks=[vigil_pl.VigilCallback(run, every=2)],
    )  # fmt: skip
    return trainer, Regression(), torch.utils.data.DataLoader(data, batch_size=4)


def test_lightning_skips_a_nan_step_saves_checkpoints_and_resumes_after_a_rollback(tmp_path):
    from vigil.integrations import lightning as vigil_pl

    root = tmp_path / "ckpt"
    link = Recorder(rollback_after(3, 2, root))
    trainer, model, data = lightning_trainer(tmp_path, a_run(root, link), nan_at=2)
    with pytest.raises(Restart):
        trainer.fit(model, data)
    assert steps_reported(link) == [(0, True, False), (1, True, False), (2, False, True), (3, True, False),
                                    (4, True, False)]  # fmt: skip
    assert finite(model), "the NaN step reached the weights"
    assert saved(root) == [2, 4]
    assert link.of(ev.RestartRequested)[0].step == 2

    again = Recorder()
    run = a_run(root, again, resume_from=manifest.step_dir(root, JOB, 4))
    trainer, model, data = lightning_trainer(tmp_path, run)
    trainer.fit(model, data, ckpt_path=vigil_pl.resume_checkpoint(run))
    assert [s for s, _, _ in steps_reported(again)] == [4, 5]
    assert saved(root) == [2, 4, 6]


def test_lightning_joins_the_ranks_the_launcher_started(monkeypatch):
    from vigil.integrations import lightning as vigil_pl

    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "NODE_RANK", "GROUP_RANK"):
        monkeypatch.delenv(name, raising=False)
    assert vigil_pl.trainer_args() == {}
    monkeypatch.setenv("RANK", "3")
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    monkeypatch.setenv("NODE_RANK", "1")
    args = vigil_pl.trainer_args()
    assert (args["devices"], args["num_nodes"]) == (2, 2)
    (env,) = args["plugins"]
    assert (env.global_rank(), env.world_size(), env.local_rank(), env.node_rank()) == (3, 4, 1, 1)
    assert env.creates_processes_externally
    with pytest.raises(ValueError, match="every"):
        vigil_pl.VigilCallback(a_run(Path("/nowhere"), Recorder()), every=0)


# --- a DeepSpeed loop ----------------------------------------------------------------------------------


@pytest.mark.parametrize("zero", [0, 1])
def test_deepspeed_helpers_skip_a_nan_update_save_and_roll_back_in_place(tmp_path, one_rank, zero):
    import deepspeed

    from vigil.integrations import deepspeed as vigil_ds

    root = tmp_path / "ckpt"
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
    config = {"train_batch_size": 4, "gradient_clipping": 1.0, "zero_optimization": {"stage": zero},
              "steps_per_print": 10**9}  # fmt: skip
    engine, _, _, _ = deepspeed.initialize(
        model=model, optimizer=torch.optim.AdamW(model.parameters(), lr=1e-2), config=config
    )
    link = Recorder(rollback_after(3, 2, root))
    run = a_run(root, link)
    vigil_ds.register_rollback(engine, run)
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(4, 8, generator=g), torch.randn(4, 1, generator=g)

    def weights() -> list[torch.Tensor]:
        return [p.detach().clone() for p in engine.module.parameters()]

    step, at_2, visited = 0, None, []
    while step < 6:
        visited.append(step)
        before = weights()
        loss = nn.functional.mse_loss(engine(x), y)
        if step == 3 and len(visited) == 4:  # once
            loss = loss * float("nan")
        engine.backward(loss)
        ok = vigil_ds.step(engine, loss, run)
        assert ok is not None
        run.report(
            step,
            loss=loss.item(),
            grad_norm=vigil_ds.grad_norm(engine),
            skipped=not engine.was_step_applied(),
        )
        if step == 3 and len(visited) == 4:
            assert not ok.all_finite and not engine.was_step_applied() and engine.skipped_steps == 1
            assert all(torch.equal(a, b) for a, b in zip(before, weights(), strict=True)), (
                "NaN update applied"
            )
        if step + 1 == 2:
            vigil_ds.save(engine, 2, run)
            at_2 = weights()
        step = run.after_step(step + 1, ok)
        if visited == [0, 1, 2, 3, 4]:  # the rollback after step 4 loaded step 2's checkpoint in place
            assert step == 2 and all(torch.equal(a, b) for a, b in zip(at_2, weights(), strict=True))
    assert visited == [0, 1, 2, 3, 4, 2, 3, 4, 5]
    assert finite(engine.module) and saved(root) == [2]
    (done,) = link.of(ev.RollbackCompleted)
    assert (done.from_step, done.to_step) == (4, 2)

    # a relaunch resumes from the checkpoint Vigil names
    resumed = a_run(root, Recorder(), resume_from=manifest.step_dir(root, JOB, 2))
    assert vigil_ds.resume(engine, resumed) == 2
    assert vigil_ds.resume(engine, a_run(root, Recorder())) == 0


@pytest.mark.parametrize("zero", [0, 1])
def test_deepspeed_snapshots_resume_from_memory_newer_than_the_checkpoint(
    tmp_path, one_rank, zero, monkeypatch
):
    import deepspeed

    from vigil import protocol as proto
    from vigil.integrations import deepspeed as vigil_ds

    monkeypatch.setenv(proto.SNAPSHOT_DIR_ENV, str(tmp_path / "shm"))
    root = tmp_path / "ckpt"
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
    config = {"train_batch_size": 4, "zero_optimization": {"stage": zero}, "steps_per_print": 10**9}
    engine, _, _, _ = deepspeed.initialize(
        model=model, optimizer=torch.optim.AdamW(model.parameters(), lr=1e-2), config=config
    )
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(4, 8, generator=g), torch.randn(4, 1, generator=g)

    def train(run: Run, step: int, until: int) -> list[list[torch.Tensor]]:
        after = []
        while step < until:
            loss = nn.functional.mse_loss(engine(x), y)
            engine.backward(loss)
            ok = vigil_ds.step(engine, loss, run)
            assert ok is not None
            if step + 1 == 2:
                vigil_ds.save(engine, 2, run)
            step = run.after_step(step + 1, ok)
            after.append([p.detach().clone() for p in engine.module.parameters()])
        return after

    run = a_run(root, Recorder())
    vigil_ds.snapshot(engine, run)  # no spec: every step
    first = train(run, 0, 7)
    run.wait_snapshots()  # the last one's files are written
    for _ in range(2):  # the weights move on past the snapshot (the steps a crash loses)
        engine.backward(nn.functional.mse_loss(engine(x), y))
        engine.step()
    assert not all(torch.equal(a, b) for a, b in zip(first[-1], engine.module.parameters(), strict=True))

    relaunched = a_run(root, Recorder(), resume_from=manifest.step_dir(root, JOB, 2))
    vigil_ds.snapshot(engine, relaunched)
    assert vigil_ds.resume(engine, relaunched) == 7  # the snapshot after step 6, not the checkpoint of 2
    assert all(torch.equal(a, b) for a, b in zip(first[-1], engine.module.parameters(), strict=True))
