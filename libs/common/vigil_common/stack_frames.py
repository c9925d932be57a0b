"""Where a rank's stack says it waits: in a collective, or somewhere of its own. Pure: a dump in.

The guardian explains a hang by it (the ranks that wait in a collective for one that does not arrive);
the worker, ending a hung attempt, ends the ranks that wait in none first, so that those waiting for
them see their collective fail and park for the next attempt (in-job restart).
"""

from __future__ import annotations

from collections.abc import Iterable

from vigil.events import RankStacks, StackFrame, ThreadStack

COLLECTIVES = frozenset(
    {
        "all_reduce",
        "all_gather",
        "all_gather_into_tensor",
        "all_gather_object",
        "all_to_all",
        "all_to_all_single",
        "barrier",
        "monitored_barrier",
        "broadcast",
        "broadcast_object_list",
        "reduce",
        "reduce_scatter",
        "reduce_scatter_tensor",
        "gather",
        "scatter",
        "send",
        "recv",
        "isend",
        "irecv",
        "wait",
        # DDP all-reduces gradients from autograd hooks in C++: a rank waiting for it sits in backward
        "backward",
        "_engine_run_backward",
        "run_backward",
        # NCCL's collectives are asynchronous: a rank waits for them where the stream is synchronized
        "synchronize",
    }
)
_COMM_FILES = (
    "torch/distributed/",
    "deepspeed/comm/",
    "c10d",
    "torch/autograd/",
    "torch/_tensor.py",
    "torch/cuda/",
)


def main_thread(r: RankStacks) -> ThreadStack | None:
    """The thread that runs the training loop: `MainThread`, else the first dumped."""
    return next((t for t in r.threads if t.name == "MainThread"), r.threads[0] if r.threads else None)


def collective(path: Iterable[StackFrame]) -> StackFrame | None:
    """The innermost frame of a collective of torch.distributed (or DeepSpeed's comm) in `path`."""
    for f in path:
        if f.function.rsplit(".", 1)[-1] in COLLECTIVES and any(p in f.file for p in _COMM_FILES):
            return f
    return None


def waits_in_collective(r: RankStacks) -> bool:
    """Whether the rank's main thread waits in a collective (False: no frame, or an error dumping it)."""
    thread = main_thread(r) if r.error is None else None
    return thread is not None and collective(thread.frames) is not None
