"""When the placement loop runs its next pass: asks coalesced, the delay bounded. Pure: the clock is an
argument.

Every change that may free or add room asks for a pass (`Scheduler.want_placement`): a submission, a rank's
start or exit, a heartbeat that changed the inventory. Under a stream of them the asks come faster than
passes end, and passes ran back to back, the scheduler busy placing while the events that free room waited
behind it. Now a pass asked for waits out a gap after the previous pass's end, and every ask made in that
gap is served by that one pass. The gap grows with the previous pass's cost (`ratio` times its duration, so
passes take about a third of the time at most under a stream), between `min_gap_s` and `max_gap_s`: the
most a placement waits beyond a pass in progress. An ask after a quiet spell, the gap long past, runs at once.
"""

from __future__ import annotations

from dataclasses import dataclass

MIN_GAP_S = 0.05
MAX_GAP_S = 0.25  # a placement waits at most this long for the next pass (beyond one in progress)
RATIO = 2.0  # the gap is this many times the previous pass's duration


@dataclass(frozen=True, slots=True)
class Pacing:
    min_gap_s: float = MIN_GAP_S
    max_gap_s: float = MAX_GAP_S
    ratio: float = RATIO

    def gap(self, took_s: float) -> float:
        """The least time between the end of a pass that took `took_s` and the start of the next one."""
        return min(self.max_gap_s, max(self.min_gap_s, self.ratio * took_s))

    def delay(self, now: float, started: float, ended: float) -> float:
        """How long a pass asked for at `now` waits, the previous one having run from `started` to `ended`
        (seconds on one clock); 0: it runs now."""
        return max(0.0, ended + self.gap(ended - started) - now)
