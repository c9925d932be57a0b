"""Measuring communication: time spent inside DeepSpeed's collectives.

`CommTimer.install()` wraps the collective methods of DeepSpeed's communication backend
(`deepspeed.comm.comm.cdb`), through which ZeRO issues every gradient all-reduce / reduce-scatter and
every parameter all-gather. What is measured, per step:

- synchronous collectives: the wall time of the call (gloo on CPU blocks until the collective is done,
  so this is the time the step waits on it);
- asynchronous ones (`async_op=True`, e.g. ZeRO-3's prefetching all-gathers): the wall time of the call
  plus the time spent in the returned handle's `wait()`;
- nested calls (a DeepSpeed helper calling another collective) are counted once.

On CUDA, NCCL returns before the collective ends, so a rank on GPU also synchronises the device at the
end of the backward pass; the comm time there is a lower bound on the overlap-free wait. Vigil's own
per-step control all-reduce goes through torch.distributed directly and is not counted here.
"""

from __future__ import annotations

import time
from typing import Any

OPS = (
    "all_reduce",
    "all_reduce_coalesced",
    "reduce",
    "reduce_scatter",
    "reduce_scatter_tensor",
    "all_gather",
    "all_gather_into_tensor",
    "all_gather_coalesced",
    "broadcast",
    "all_to_all_single",
)


class _TimedWork:
    """A collective's handle whose `wait()` is timed; everything else is passed through."""

    def __init__(self, work: Any, timer: CommTimer) -> None:
        self._work, self._timer = work, timer

    def wait(self, *args: Any, **kwargs: Any) -> Any:
        t0 = time.perf_counter()
        try:
            return self._work.wait(*args, **kwargs)
        finally:
            self._timer.seconds += time.perf_counter() - t0

    def __getattr__(self, name: str) -> Any:
        return getattr(self._work, name)


class CommTimer:
    def __init__(self) -> None:
        self.seconds = 0.0
        self.calls = 0
        self._depth = 0

    def install(self) -> CommTimer:
        from deepspeed.comm import comm as ds_comm

        backend = ds_comm.cdb
        if backend is None:
            raise RuntimeError("CommTimer.install() needs deepspeed.init_distributed() first")
        for name in OPS:
            if hasattr(backend, name):
                setattr(backend, name, self._wrap(getattr(backend, name)))
        return self

    def _wrap(self, fn: Any) -> Any:
        def timed(*args: Any, **kwargs: Any) -> Any:
            if self._depth:
                return fn(*args, **kwargs)
            self._depth += 1
            t0 = time.perf_counter()
            try:
                out = fn(*args, **kwargs)
            finally:
                self._depth -= 1
                self.seconds += time.perf_counter() - t0
                self.calls += 1
            return _TimedWork(out, self) if kwargs.get("async_op") and out is not None else out

        timed.__wrapped__ = fn  # type: ignore[attr-defined]
        return timed

    def take(self) -> float:
        """Seconds measured since the last call."""
        seconds, self.seconds = self.seconds, 0.0
        return seconds
