"""A preemption notice, as a rank hears it: SIGUSR1 from its worker (which got SIGTERM or saw the cloud's
notice file). The handler only sets a flag; the loop puts it into the step boundary's all-reduce, so all
ranks write the emergency checkpoint after the same step and exit with EXIT_PREEMPTED.

A notice may come while the rank still starts (the scheduler preempts a job, or stops it at its time
limit, whenever it runs): a program that calls `listen_early()` first thing keeps it (a SIGUSR1's default
action would end the process), and the `PreemptionNotice` installed later takes it over."""

from __future__ import annotations

import logging
import signal
import time
from types import FrameType

log = logging.getLogger("vigil.rank")

SIGNAL = signal.SIGUSR1  # what a worker sends its ranks (SIGTERM stays "end now", as on cancel)


_early_at: float | None = None  # when a notice came before a `PreemptionNotice` was installed


def listen_early() -> None:
    """Keep a preemption notice that comes before the program installs its `PreemptionNotice` (while it
    imports torch, say): call it first thing in the main thread."""
    signal.signal(SIGNAL, _on_early_signal)


def _on_early_signal(signum: int, frame: FrameType | None) -> None:
    global _early_at
    if _early_at is None:
        _early_at = time.monotonic()


class PreemptionNotice:
    def __init__(self) -> None:
        self.at: float | None = None  # time.monotonic() when the notice came

    @property
    def requested(self) -> bool:
        return self.at is not None

    def install(self) -> PreemptionNotice:
        global _early_at
        signal.signal(SIGNAL, self._on_signal)
        if _early_at is not None:  # it came while the program started (`listen_early`): taken over, once
            self.at, _early_at = self.at or _early_at, None
            log.warning("preemption notice (during start): checkpointing at the next step boundary")
        return self

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        if self.at is None:
            self.at = time.monotonic()
            log.warning("preemption notice: checkpointing at the next step boundary")
