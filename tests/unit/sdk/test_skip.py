"""The one skip (`vigil.integrations.deepspeed.skip_step`) on a real DeepSpeed engine of one CPU rank, in
every ZeRO stage, fp32 and bf16: a held (finite) update and a NaN one leave the weights, the optimizer
state and the LR schedule as they were, and the next update is applied as usual."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from vigil.integrations import ds_compat
from vigil.integrations.deepspeed import skip_step
from vigil.integrations.gate import Sample, gate

CASES = [(0, "fp32"), (0, "bf16"), (1, "fp32"), (1, "bf16"), (2, "fp32"), (3, "fp32"), (3, "bf16")]


def build(stage: int, precision: str) -> Any:
    import deepspeed

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
    config: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": 2,
        "gradient_clipping": 1.0,
        "zero_optimization": {"stage": stage},
        "scheduler": {"type": "WarmupCosineLR", "params": {"total_num_steps": 20, "warmup_num_steps": 5}},
        "steps_per_print": 10**9,
    }
    if precision == "bf16":
        config["bf16"] = {"enabled": True}
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=opt, config=config)
    return engine


def one_step(engine: Any, factor: float = 1.0, *, skip: bool = False) -> None:
    """Two micro-steps, then the boundary's step (or its skip)."""
    dtype = next(engine.module.parameters()).dtype
    g = torch.Generator().manual_seed(engine.global_steps)
    for micro in range(2):
        x, y = torch.randn(2, 8, generator=g).to(dtype), torch.randn(2, 1, generator=g).to(dtype)
        loss = nn.functional.mse_loss(engine(x), y) * factor
        engine.backward(loss)
        if micro == 0 or not skip:
            engine.step()
    if skip:
        skip_step(engine)


def snapshot(engine: Any) -> dict[str, Any]:
    """Everything a step may change on this rank: the weights it holds, the optimizer's state, the LR."""
    opt = ds_compat.client_optimizer(engine)
    state = [t.clone() for s in opt.state.values() for t in s.values() if torch.is_tensor(t)]
    return {
        "weights": [t.clone() for t in ds_compat.local_shards(engine)],
        "state": state,
        "lr": engine.get_lr(),
        "iteration": engine.lr_scheduler.last_batch_iteration,
        "last_lr": list(engine.lr_scheduler.get_last_lr()),
    }


def same(a: dict[str, Any], b: dict[str, Any]) -> bool:
    tensors = all(
        len(a[k]) == len(b[k]) and all(torch.equal(x, y) for x, y in zip(a[k], b[k], strict=True))
        for k in ("weights", "state")
    )
    return tensors and all(a[k] == b[k] for k in ("lr", "iteration", "last_lr"))


@pytest.mark.parametrize(("stage", "precision"), CASES)
def test_a_skipped_step_changes_nothing_and_the_next_one_trains(one_rank, stage, precision):
    engine = build(stage, precision)
    before = snapshot(engine)
    one_step(engine, 100.0, skip=True)  # held at the very first step: a finite spike
    assert not engine.was_step_applied() and engine.skipped_steps == 1
    assert same(before, snapshot(engine))

    one_step(engine)
    assert engine.was_step_applied()
    trained = snapshot(engine)
    assert not same(before, trained) and trained["iteration"] == before["iteration"] + 1

    one_step(engine, float("nan"), skip=True)  # DeepSpeed or the gate: either way, nothing moves
    assert not engine.was_step_applied() and engine.skipped_steps == 2
    assert same(trained, snapshot(engine))

    one_step(engine)
    after = snapshot(engine)
    assert engine.was_step_applied() and engine.skipped_steps == 2
    assert not same(trained, after) and after["iteration"] == trained["iteration"] + 1
    assert all(torch.isfinite(t).all() for t in after["weights"])


def test_skip_step_between_accumulation_boundaries_is_refused(one_rank):
    engine = build(1, "fp32")
    loss = nn.functional.mse_loss(engine(torch.randn(2, 8)), torch.randn(2, 1))
    engine.backward(loss)
    with pytest.raises(RuntimeError, match="accumulation boundary"):
        skip_step(engine)


def test_the_gate_holds_the_step_only_while_shut_and_counts_what_it_held():
    p = nn.Parameter(torch.ones(3))
    opt = torch.optim.SGD([p], lr=0.5)
    g = gate(opt)
    assert gate(opt) is g  # installed once
    p.grad = torch.ones(3)
    with g.shut():
        opt.step()
    assert torch.equal(p.detach(), torch.ones(3)) and g.blocked == 1
    opt.step(lambda: None)  # open again, a closure passed through
    assert torch.equal(p.detach(), torch.full((3,), 0.5)) and g.blocked == 1
    # a torch LR scheduler made afterwards wraps the gated step, which still holds
    torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    with g.shut():
        opt.step()
    assert torch.equal(p.detach(), torch.full((3,), 0.5)) and g.blocked == 2
    opt.step()
    assert torch.equal(p.detach(), torch.zeros(3))


def test_the_sample_tells_a_change_from_none_nan_included():
    w = torch.tensor([1.0, float("nan"), 3.0])
    sample = Sample([w, torch.zeros(0)])
    assert sample.unchanged()
    w[2] = 3.5
    assert not sample.unchanged()
