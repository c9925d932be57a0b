"""What bounds a rank's reports beyond their models: a rate per rank, and the reports of refusals.

A rank may publish `EVENTS_PER_S` events a second on average, `BURST` at once (a token bucket per rank:
a step a millisecond is far beyond any real training loop). An event over the rate is refused with a
reply, as any refused event is. Each refusal is also a fact for the guardian (`ReportRefused`, which it
records as a `report_refused` incident), but a flood of refusals must not become a flood of incidents:
`RefusalReports` lets one through per job and field every `REPORT_EVERY_S`, counting the rest into it.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

EVENTS_PER_S = 500.0
BURST = 2000
REPORT_EVERY_S = 30.0


@dataclass
class TokenBucket:
    """`rate` tokens a second, at most `burst` saved up; `take` spends one if there is one."""

    rate: float = EVENTS_PER_S
    burst: int = BURST
    tokens: float = field(init=False)
    at: float = field(default_factory=time.monotonic)

    def __post_init__(self) -> None:
        self.tokens = float(self.burst)

    def take(self, now: float | None = None) -> bool:
        now = time.monotonic() if now is None else now
        self.tokens = min(float(self.burst), self.tokens + (now - self.at) * self.rate)
        self.at = now
        if self.tokens < 1.0:
            return False
        self.tokens -= 1.0
        return True


@dataclass
class RefusalReports:
    """Which refusals to report: the first of a job's field, then one every `every_s`, each with the
    number of refusals since the one reported before it."""

    every_s: float = REPORT_EVERY_S
    _last: dict[tuple[str, str], float] = field(default_factory=dict)
    _since: dict[tuple[str, str], int] = field(default_factory=dict)

    def due(self, job_id: str, field_name: str, now: float | None = None) -> int:
        """Count one refusal; how many to report now (0: not yet, it is counted into the next)."""
        now = time.monotonic() if now is None else now
        key = (job_id, field_name)
        self._since[key] = self._since.get(key, 0) + 1
        last = self._last.get(key)
        if last is not None and now - last < self.every_s:
            return 0
        self._last[key] = now
        return self._since.pop(key)

    def forget(self, job_id: str) -> None:
        for key in [k for k in self._last if k[0] == job_id]:
            del self._last[key]
        for key in [k for k in self._since if k[0] == job_id]:
            del self._since[key]
