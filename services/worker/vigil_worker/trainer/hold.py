"""Holding a step: the ranks judged it bad at the boundary, so the next `engine.step()` must not apply it.

DeepSpeed already knows how to drop an update: every one of its optimizers skips a step whose gradient
norm is not finite (clears the gradients, leaves the weights, the optimizer state and the learning-rate
schedule alone, and counts the step as skipped). A held step's gradients are finite (a spike), so the
hold makes the optimizer see an invalid norm for its next step, through the one method each optimizer
computes it with; `GuardedAdamW` (fp32 without ZeRO) has its own flag. All ranks hold together (they
judged the same numbers), so the optimizers' own collectives stay in line.

Under fp16 the loss scaler also reads a held step as an overflow and halves its scale, as it would for a
real one.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

from vigil_worker.trainer.model import GuardedAdamW

_INVALID = float("inf")


def drop_step(engine: Any) -> None:
    """The accumulation boundary's `engine.step()`, skipped: its gradients dropped, nothing applied."""
    with _held(engine):
        engine.step()


@contextlib.contextmanager
def _held(engine: Any) -> Iterator[None]:
    """While inside, `engine`'s optimizer sees an invalid gradient norm (an optimizer that finds the
    gradients non-finite by itself never asks: the shadow is removed on the way out all the same)."""
    opt = engine.optimizer
    if isinstance(opt, GuardedAdamW):
        opt.overflow = True
        yield
        return
    method = next((m for m in _NORM_METHODS if hasattr(opt, m[0])), None)
    if method is None:
        # Any other optimizer reads the parameters' gradients at its step: make them non-finite.
        for p in engine.module.parameters():
            if p.grad is not None:
                p.grad.fill_(float("nan"))
        yield
        return
    name, invalid = method
    opt.__dict__[name] = lambda *args, **kwargs: invalid(opt)
    try:
        yield
    finally:
        opt.__dict__.pop(name, None)


def _norm_tensor(opt: Any) -> torch.Tensor:
    device = next((p.device for g in opt.param_groups for p in g["params"]), torch.device("cpu"))
    return torch.tensor(_INVALID, device=device)


# The method each DeepSpeed optimizer computes its step's gradient norm with, and what it returns.
_NORM_METHODS: tuple[tuple[str, Any], ...] = (
    ("scaled_global_norm", lambda opt: _INVALID),  # ZeRO 1 and 2 (stage_1_and_2.py)
    ("_get_norm_groups", lambda opt: [_norm_tensor(opt)]),  # ZeRO 3 (stage3.py)
    ("get_grads_for_norm", lambda opt: ([_norm_tensor(opt)], [])),  # BF16_Optimizer (ZeRO 0, bf16)
)
