"""The one way Vigil drops an update under DeepSpeed: the program's own optimizer, its `step()` gated.

As torchft's `OptimizerWrapper` does, the skip lives in the optimizer the program already holds, not in
patches of a framework's private functions: while the gate is shut, `step()` returns without touching
the parameters or the optimizer's state. Whatever DeepSpeed wraps around that optimizer (ZeRO 1-3,
BF16_Optimizer, FP16_Optimizer) runs as usual around it: gradients are reduced, clipped and freed, and
the copy of the (unchanged) fp32 weights back into the model leaves the model as it was. The gate is
installed on the optimizer instance the first time a step is skipped (`gate`), so a program's optimizer
of any class is gated the same way; `vigil.integrations.deepspeed.skip_step` is its one user.

`Sample` is the check after a skipped step: a few elements of every tensor this rank holds, compared
before and after (a few kilobytes; taken only on a skipped step, so a step that is applied pays nothing).
"""

from __future__ import annotations

import contextlib
import types
from collections.abc import Iterator
from typing import Any

import torch

SAMPLE = 64  # elements of each tensor the check compares


class Gate:
    """An optimizer's `step()`, run only while the gate is open; `blocked` counts the steps it refused."""

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        self._step = optimizer.step  # as it was: the class's step with torch's hooks, or a wrapper of it
        self.closed = False
        self.blocked = 0
        optimizer.vigil_gate = self  # type: ignore[attr-defined]
        # a method of the optimizer itself, so that what wraps `step` later (a torch LR scheduler does)
        # rebinds it to the optimizer as it would the class's own
        optimizer.step = types.MethodType(_gated_step, optimizer)  # type: ignore[method-assign]

    @contextlib.contextmanager
    def shut(self) -> Iterator[None]:
        """While inside, the optimizer's `step()` does nothing."""
        self.closed = True
        try:
            yield
        finally:
            self.closed = False


def _gated_step(optimizer: torch.optim.Optimizer, closure: Any = None, **kwargs: Any) -> Any:
    g: Gate = optimizer.vigil_gate  # type: ignore[attr-defined]
    if g.closed:
        g.blocked += 1
        return None
    return g._step(**kwargs) if closure is None else g._step(closure, **kwargs)


def gate(optimizer: torch.optim.Optimizer) -> Gate:
    """The optimizer's gate, installed on first use."""
    got = getattr(optimizer, "vigil_gate", None)
    return got if isinstance(got, Gate) else Gate(optimizer)


class Sample:
    """The first `SAMPLE` elements of each tensor, copied, to tell later whether any of them changed."""

    def __init__(self, tensors: list[torch.Tensor]) -> None:
        self.tensors = tensors
        self.before = _heads(tensors)

    def unchanged(self) -> bool:
        """True when every sampled element is as it was (NaN as NaN). One host sync."""
        if self.before is None:
            return True
        now = _heads(self.tensors)
        assert now is not None
        same = (self.before == now) | (self.before.isnan() & now.isnan())
        return bool(same.all())


def _heads(tensors: list[torch.Tensor]) -> torch.Tensor | None:
    """The first elements of every tensor, as one fp32 tensor on the first one's device (a copy)."""
    heads = [t.detach().reshape(-1)[:SAMPLE] for t in tensors if t.numel()]
    if not heads:
        return None
    device = heads[0].device
    return torch.cat([h.to(device, torch.float32, non_blocking=True) for h in heads])
