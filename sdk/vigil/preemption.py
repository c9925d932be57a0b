"""A preemption notice, as a rank hears it: SIGUSR1 from its worker (which got SIGTERM or saw the cloud's
notice file). The handler only sets a flag; the loop puts it into the step boundary's all-reduce, so all
ranks write the emergency checkpoint after the same step and exit with EXIT_PREEMPTED."""

from __future__ import annotations

import logging
import signal
import time
from types import FrameType

log = logging.getLogger("vigil.rank")

SIGNAL = signal.SIGUSR1  # what a worker sends its ranks (SIGTERM stays "end now", as on cancel)


class PreemptionNotice:
    def __init__(self) -> None:
        self.at: float | None = None  # time.monotonic() when the notice came

    @property
    def requested(self) -> bool:
        return self.at is not None

    def install(self) -> PreemptionNotice:
        signal.signal(SIGNAL, self._on_signal)
        return self

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        if self.at is None:
            self.at = time.monotonic()
            log.warning("preemption notice: checkpointing at the next step boundary")
