"""The few collectives the SDK runs itself, each a no-op without a process group of more than one rank
(one rank, or a program outside torch.distributed): barriers around a checkpoint, rank 0's choice sent
to every rank, and a yes or a number every rank agrees on."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch


def distributed() -> bool:
    """True inside a torch.distributed group of more than one rank."""
    try:
        import torch.distributed as dist
    except ImportError:
        return False
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def device() -> torch.device:
    """Where a collective of this process group runs: the current GPU under NCCL, else the CPU."""
    import torch
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized() and dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def barrier() -> None:
    if distributed():
        import torch.distributed as dist

        dist.barrier()


def broadcast(objects: list[Any]) -> None:
    """Rank 0's `objects` on every rank (in place)."""
    if distributed():
        import torch.distributed as dist

        dist.broadcast_object_list(objects, src=0)


def everywhere(flag: bool) -> bool:
    """True when `flag` is True on every rank."""
    return lowest(1 if flag else 0) == 1


def lowest(n: int) -> int:
    """The smallest of every rank's `n`."""
    return _reduce(n, "MIN")


def highest(n: int) -> int:
    """The largest of every rank's `n`."""
    return _reduce(n, "MAX")


def _reduce(n: int, op: str) -> int:
    if not distributed():
        return n
    import torch
    import torch.distributed as dist

    t = torch.tensor([n], dtype=torch.int64, device=device())
    dist.all_reduce(t, op=getattr(dist.ReduceOp, op))
    return int(t.item())
