"""The step boundary: what every rank agrees on before each optimizer step, the same on every rank.

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

Under DDP the same numbers can ride in DDP's own gradient all-reduce instead (`Carrier`, a DDP
communication hook): no collective of the boundary's own in the common step. An out-of-memory rank, a
step without DDP's all-reduce, DeepSpeed, or a model not wrapped in DDP agree through `agree`.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, NamedTuple

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


class Carrier:
    """The step boundary carried inside DDP's own gradient all-reduce: no collective of its own per step.

    A DDP communication hook all-reduces each bucket as DDP itself does (scaled by 1/world size, then
    summed: bit for bit DDP's gradients), and appends a tail to bucket 0 (DDP's smallest, so the copy is
    small): this rank's preemption flag, and one slot per rank for its latest command number and its
    loss, zeros in the other ranks' slots. A sum of one value and zeros is that value, so after the
    all-reduce every rank holds every rank's numbers, the same bits on all. The gradients' own finiteness
    needs no slot: a NaN anywhere reaches every rank's reduced gradients, which are the same on every rank,
    so each rank judges them alike after the reduction (`take`'s `finite`).

    The tail travels in the gradients' dtype; where that is not fp32 or fp64, or in a backward without
    DDP's all-reduce (`no_sync`, accumulation micro-steps), nothing is carried and `take` returns None:
    the caller agrees through `agree`'s collective instead, on every rank alike. Losses are carried at the
    gradients' precision (an fp32 loss exactly) and command numbers exactly up to 2**24.
    """

    def __init__(
        self,
        *,
        rank: int,
        world_size: int,
        news: Callable[[], tuple[int, bool]],
        loss: Callable[[], torch.Tensor | None],
    ) -> None:
        self.rank, self.world_size = rank, world_size
        self._news = news  # at the hook: (this rank's latest command number, preemption noticed?)
        self._loss = loss  # at the hook: this rank's loss for the step (a 0-d tensor), or None
        self._group: Any = None
        self._reduced: torch.Tensor | None = None  # the newest backward's reduced tail, not yet taken

    def attach(self, ddp: Any) -> bool:
        """Register the hook on `ddp`, a `DistributedDataParallel` over every rank; False where it cannot
        (another module, a hook of its own already, DDP's mixed precision, a group of fewer ranks)."""
        import torch.distributed as dist
        from torch.nn.parallel import DistributedDataParallel

        if not isinstance(ddp, DistributedDataParallel) or getattr(ddp, "mixed_precision", None) is not None:
            return False
        group = ddp.process_group
        if group.size() != self.world_size or dist.get_rank(group) != self.rank:
            return False
        if getattr(ddp, "_comm_hooks", None):  # the program's own hook (DDP would still list ours)
            return False
        self._group = group
        try:
            ddp.register_comm_hook(None, self._hook)
        except RuntimeError:  # DDP takes one hook: the program registered its own
            return False
        return True

    def _hook(self, _state, bucket):  # type: ignore[no-untyped-def]  # DDP rejects string annotations
        """Per bucket: a `dist.GradBucket` in, a future of its reduced buffer out."""
        import torch
        import torch.distributed as dist

        buf = bucket.buffer()
        buf.mul_(1.0 / self.world_size)  # as DDP scales without a hook (a division rounds otherwise)
        if bucket.index() != 0 or buf.dtype not in (torch.float32, torch.float64):
            work = dist.all_reduce(buf, group=self._group, async_op=True)
            return work.get_future().then(lambda fut: fut.value()[0])
        n, world = buf.numel(), self.world_size
        seq, preempt = self._news()
        tail = torch.zeros(1 + 2 * world, device=buf.device, dtype=buf.dtype)
        tail[0], tail[1 + self.rank] = float(preempt), float(seq)
        loss = self._loss()
        if loss is not None:
            tail[1 + world + self.rank] = loss.detach().reshape(()).to(buf.device, buf.dtype)  # no sync
        flat = torch.cat([buf, tail])

        def done(fut: torch.futures.Future[list[torch.Tensor]]) -> torch.Tensor:
            out = fut.value()[0]
            self._reduced = out[n:]
            return out[:n]

        return dist.all_reduce(flat, group=self._group, async_op=True).get_future().then(done)

    def take(self, finite: torch.Tensor | bool, *, losses: bool = False) -> Boundary | None:
        """What every rank agreed on in the newest backward since the last `take`, or None where none
        carried it. `finite` is this rank's verdict on its loss and on the gradients after DDP's
        all-reduce (nothing else: it is not exchanged); `losses`: fill `Boundary.losses`."""
        import torch

        tail, self._reduced = self._reduced, None
        if tail is None:
            return None
        flag = finite.reshape(1).to(tail) if isinstance(finite, torch.Tensor) else tail.new_ones(1) * finite
        got = torch.cat([tail, flag]).tolist()  # CPU-GPU sync point (the one per step)
        world = self.world_size
        slots = got[1 + world : 1 + 2 * world]
        return Boundary(
            all(math.isfinite(x) for x in slots) and got[-1] == 1.0,
            int(max(got[1 : 1 + world])),
            None,
            got[0] > 0,
            tuple(x if math.isfinite(x) else math.nan for x in slots) if losses else None,
        )
