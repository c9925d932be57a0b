"""Measuring communication: time spent inside DeepSpeed's collectives.

`CommTimer.install()` wraps the collective methods of DeepSpeed's communication backend
(`ds_compat.comm_backend()`), through which ZeRO issues every gradient all-reduce / reduce-scatter and
every parameter all-gather. What is measured, per step:

- synchronous collectives: the wall time of the call (gloo on CPU blocks until the collective is done,
  so this is the time the step waits on it);
- asynchronous ones (`async_op=True`, e.g. ZeRO-3's prefetching all-gathers): the wall time of the call
  plus the time spent in the returned handle's `wait()`;
- nested calls (a DeepSpeed helper calling another collective) are counted once.

On CUDA, NCCL returns before the collective ends, so wall-clock readings would time the launch: there
each collective is bracketed by CUDA events on the stream it is issued on (for an async one, the end is
recorded at its `wait()`), and `take()` reads them after the step's one synchronisation. With
`overlap_comm` the measured time includes what ran beside the backward, so on GPU it is the time a
collective took on its stream (waiting for the slowest rank included, which is what imbalance detection
needs), not the time the step waited on it. Vigil's own per-step control all-reduce goes through
torch.distributed directly and is not counted here.
"""

from __future__ import annotations

from typing import Any

from vigil.integrations import ds_compat
from vigil_trainer.clock import Clock

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
        t0 = self._timer.clock.now()
        try:
            return self._work.wait(*args, **kwargs)
        finally:
            self._timer.spans.append((t0, self._timer.clock.now()))

    def __getattr__(self, name: str) -> Any:
        return getattr(self._work, name)


class CommTimer:
    def __init__(self, clock: Clock | None = None) -> None:
        self.clock = clock or Clock()
        self.spans: list[tuple[Any, Any]] = []  # (start, end) marks since the last take()
        self.calls = 0
        self._depth = 0

    def install(self) -> CommTimer:
        backend = ds_compat.comm_backend()
        for name in OPS:
            if hasattr(backend, name):
                setattr(backend, name, self._wrap(getattr(backend, name)))
        return self

    def _wrap(self, fn: Any) -> Any:
        def timed(*args: Any, **kwargs: Any) -> Any:
            if self._depth:
                return fn(*args, **kwargs)
            self._depth += 1
            t0 = self.clock.now()
            try:
                out = fn(*args, **kwargs)
            finally:
                self._depth -= 1
                self.spans.append((t0, self.clock.now()))
                self.calls += 1
            return _TimedWork(out, self) if kwargs.get("async_op") and out is not None else out

        timed.__wrapped__ = fn  # type: ignore[attr-defined]
        return timed

    def take_spans(self) -> list[tuple[Any, Any]]:
        """The marks of the collectives since the last take, to be read later (`total`)."""
        spans, self.spans = self.spans, []
        return spans

    def total(self, spans: list[tuple[Any, Any]]) -> float:
        """Seconds in `spans` (on GPU: read them after the step's sync point)."""
        return sum(self.clock.between(a, b) for a, b in spans)

    def take(self) -> float:
        """Seconds measured since the last take."""
        return self.total(self.take_spans())
