"""The step boundary: one small all-reduce before each optimizer step, the same on every rank.

All ranks all-reduce MIN over [all finite?, -commands seen, lowest rank out of memory (the world size:
none), preemption noticed? (0: yes)]. Every rank learns whether any rank saw a non-finite loss or
gradient (torchtitan's guard), the highest command number any rank has received (so that all act on
the same commands after the same step), whether a rank ran out of memory in this step, and whether a
rank's node is being preempted. One collective carries all four; it is the step's one CPU-GPU sync.

Given this rank's `loss`, the same collective also carries every rank's loss: one slot per rank after
the four, this rank's holding its loss (a non-finite one as -inf) and the others +inf, so that after
the MIN every rank holds every rank's loss, bit for bit the same numbers on all ranks. The built-in
trainer judges them with the job's spike rule before the optimizer step, identically on every rank.

Without a process group (one rank, or outside torch.distributed) the answer is this rank's own.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, NamedTuple

from vigil import collective

if TYPE_CHECKING:
    import torch


class Boundary(NamedTuple):
    """What all ranks agreed on at a step boundary."""

    all_finite: bool  # every rank's loss and gradients were finite
    agreed_seq: int  # the highest command number any rank has received
    oom_rank: int | None = None  # the lowest rank that ran out of memory in this step; None: none did
    preempt: bool = False  # some rank's node got a preemption notice
    losses: tuple[float, ...] | None = None  # every rank's loss (NaN: not finite), when `loss` was given


def agree(
    finite: torch.Tensor | bool,
    *,
    latest_seq: int,
    rank: int,
    world_size: int,
    oom: bool = False,
    preempt: bool = False,
    loss: torch.Tensor | None = None,
) -> Boundary:
    """This rank's news in, everyone's out. `finite` is this rank's verdict on its loss (a 0-d tensor on
    the training device keeps the step free of an extra sync; a bool is moved there); `loss`, this
    rank's loss for the step (a 0-d tensor on the same device), to learn every rank's."""
    import torch
    import torch.distributed as dist

    device = finite.device if isinstance(finite, torch.Tensor) else collective.device()
    flag = finite.float().reshape(1) if isinstance(finite, torch.Tensor) else torch.ones(1, device=device)
    if not isinstance(finite, torch.Tensor) and not finite:
        flag = torch.zeros(1, device=device)
    news = [-float(latest_seq), float(rank if oom else world_size), 0.0 if preempt else 1.0]
    parts = [flag, torch.tensor(news, device=device, dtype=flag.dtype)]
    if loss is not None:
        slots = torch.full((world_size,), math.inf, device=device, dtype=torch.float64)
        own = loss.detach().to(torch.float64).reshape(())
        slots[rank] = torch.where(torch.isfinite(own), own, -math.inf)
        parts = [p.to(torch.float64) for p in parts] + [slots]
    ctrl = torch.cat(parts)
    if collective.distributed():
        dist.all_reduce(ctrl, op=dist.ReduceOp.MIN)
    got = ctrl.tolist()  # CPU-GPU sync point (the one per step)
    oom_rank = int(got[2])
    losses = tuple(x if math.isfinite(x) else math.nan for x in got[4:]) if loss is not None else None
    return Boundary(
        got[0] == 1.0, int(-got[1]), oom_rank if oom_rank < world_size else None, got[3] == 0.0, losses
    )
