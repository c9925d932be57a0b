"""Marks on a step's timeline: the wall clock on CPU, CUDA events on GPU.

On GPU the host runs ahead of the device, so a wall-clock reading after a kernel launch says when it was
queued, not when it ran; synchronising after each phase to make it honest costs a stall per phase. A CUDA
event instead records where the device's stream is, and is read after the step's one synchronisation
(by then every event of the step has been reached, so reading it does not wait). Same interface either
way: `now()` makes a mark, `between(a, b)` is the seconds from one to the other.
"""

from __future__ import annotations

import time
from typing import Any

import torch


class Clock:
    def __init__(self, cuda: bool = False) -> None:
        self.cuda = cuda

    def now(self) -> Any:
        if not self.cuda:
            return time.perf_counter()
        mark = torch.cuda.Event(enable_timing=True)
        mark.record()  # on the current stream: a collective issued on a side stream is timed there
        return mark

    def between(self, a: Any, b: Any) -> float:
        """Seconds from mark `a` to mark `b` (on GPU: read after the step's sync point, no wait)."""
        if not self.cuda:
            return float(b - a)
        if not b.query():  # not reached yet: only when read before the step's synchronisation
            b.synchronize()
        return a.elapsed_time(b) / 1000.0

    def sync(self) -> None:
        """The step's one CPU-GPU synchronisation (nothing to do on CPU)."""
        if self.cuda:
            torch.cuda.synchronize()
