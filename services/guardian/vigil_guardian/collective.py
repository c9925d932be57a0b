"""Collective imbalance and stragglers, from the ranks' measured times of one step.

In synchronous data parallelism every rank meets the others in a collective each step. A slow
rank computes longer and reaches the collective last, so it waits least there while the others
wait for it: the spread of the ranks' compute times and of their communication waits, as a
fraction of the step time, measures the imbalance, and the rank with the most compute and the
least waiting is the straggler. A rank that is late after the collective (its step event arrives
well after its peers') is a straggler of the other kind, seen by the spread of arrival times.

Both judge one step at a time, so they need a large spread. A rank that is persistently a little
slower (from about 5 % of its compute) is found by `StragglerScores`: each rank's compute time
relative to the median rank's, its median over a window of steps (as NVIDIA's resiliency extension
scores ranks), so jitter and a single slow step cancel out. A rank slow enough that its per-step
spread sits near the threshold (now above it, now under) makes runs of imbalanced steps that rarely
last `steps`; its score still finds it.
"""

from __future__ import annotations

import math
import statistics
from collections import Counter, deque
from collections.abc import Sequence
from dataclasses import dataclass

from vigil.events import StepCompleted
from vigil_guardian.verdict import Verdict

# A spread smaller than this is scheduling jitter, not a straggler, however large a share of a
# very short step it is (a 10 ms hiccup is 20 % of a 50 ms CPU step, and 1 % of a 1 s GPU step).
MIN_SPREAD_S = 0.05


@dataclass(frozen=True)
class StepSpread:
    """The spreads of one complete step across ranks."""

    step: int
    ratio: float  # max(compute spread, comm spread) / step time
    arrival_ratio: float  # spread of the ranks' event times / step time
    straggler: int  # the rank with the most compute and the least waiting
    late: int  # the rank whose event came last
    step_time_s: float


def spread(events: Sequence[StepCompleted]) -> StepSpread:
    """The imbalance of one step from every rank's event of that step (two or more ranks)."""
    if len(events) < 2:
        raise ValueError("an imbalance needs the events of two or more ranks")
    step_time = max(max(e.step_time_s for e in events), 1e-9)
    compute = {e.rank: max(e.step_time_s - e.comm_time_s, 0.0) for e in events}
    comm = {e.rank: e.comm_time_s for e in events}
    worst = max(max(compute.values()) - min(compute.values()), max(comm.values()) - min(comm.values()))
    ratio = worst / step_time if worst >= MIN_SPREAD_S else 0.0
    straggler = max(compute, key=lambda r: (compute[r] - comm[r], -r))
    times = {e.rank: e.occurred_at.timestamp() for e in events}
    late = max(times, key=lambda r: (times[r], -r))
    late_by = max(times.values()) - min(times.values())
    arrival = late_by / step_time if late_by >= MIN_SPREAD_S else 0.0
    return StepSpread(events[0].step, ratio, arrival, straggler, late, step_time)


class ImbalanceTracker:
    """Counts consecutive imbalanced steps; one verdict per episode (until a balanced step).

    A step whose compute/comm spread is above the threshold counts toward `imbalance`; a step that
    is balanced by that measure but whose arrival spread is above the threshold counts toward
    `straggler`. Either count reaching `steps` gives one verdict naming the rank most often at fault.
    """

    def __init__(self, threshold: float, steps: int) -> None:
        self.threshold = threshold
        self.steps = steps
        self._run: list[tuple[str, int, StepSpread]] = []  # (kind, rank, spread) of consecutive bad steps
        self._raised: str | None = None

    def observe(self, events: Sequence[StepCompleted], nodes: dict[int, str]) -> Verdict | None:
        """Feed one complete step (every rank's event); returns a verdict when an episode starts."""
        if len(events) < 2:
            return None
        s = spread(events)
        if s.ratio > self.threshold:
            kind, rank = "imbalance", s.straggler
        elif s.arrival_ratio > self.threshold:
            kind, rank = "straggler", s.late
        else:
            self._run.clear()
            self._raised = None
            return None
        if self._run and self._run[-1][0] != kind:
            self._run.clear()
        self._run.append((kind, rank, s))
        if len(self._run) < self.steps or self._raised == kind:
            return None
        self._raised = kind
        recent = self._run[-self.steps :]
        culprit, count = Counter(r for _, r, _ in recent).most_common(1)[0]
        ratios = [round(x.ratio if kind == "imbalance" else x.arrival_ratio, 4) for _, _, x in recent]
        node = nodes.get(culprit, next((e.node for e in events if e.rank == culprit), None))
        what = "compute/communication spread" if kind == "imbalance" else "late arrival"
        return Verdict(
            kind=kind,  # type: ignore[arg-type]
            step=s.step,
            rank=culprit,
            node=node,
            message=f"{kind} at step {s.step}: rank {culprit} on {node} is the straggler ({what} "
            f"{ratios[-1]:.0%} of the step time for {self.steps} steps, threshold {self.threshold:.0%})",
            evidence={
                "ratios": ratios,
                "threshold": self.threshold,
                "steps": [x.step for _, _, x in recent],
                "straggler_share": count / len(recent),
                "step_time_s": s.step_time_s,
            },
        )

    def reset(self) -> None:
        self._run.clear()
        self._raised = None


SCORE_WINDOW = 30  # complete steps a rank's relative score is the median of
# A score this far above 1 is a straggler. A rank 10 % slower in forward and backward is about 9 %
# slower in compute (the optimizer step is not slower), and scores about 7.5 % with 3 % jitter (the
# median rank's time includes a little of the jitter); a clean rank's score over 30 steps stays
# within about 2 % of 1 at that jitter and 3.5 % at 5 %.
SCORE_THRESHOLD = 0.05
# The window's median takes out jitter, so a smaller absolute floor than a single step's will do.
SCORE_MIN_S = 0.01


class StragglerScores:
    """Per rank, the median over the last `window` steps of its compute time relative to the median
    rank's. A rank whose score passes `1 + threshold` gives one verdict (kind "imbalance"), and no
    other until its score over steps all after the report is back under `1 + threshold / 2`. A rank
    reported by another detector is marked the same way (`mark`), so one slow rank is one incident."""

    def __init__(self, window: int = SCORE_WINDOW, threshold: float = SCORE_THRESHOLD) -> None:
        self.window = window
        self.threshold = threshold
        self._relative: dict[int, deque[float]] = {}
        self.reported: dict[int, int] = {}  # rank reported slow -> steps seen since

    def observe(self, events: Sequence[StepCompleted], nodes: dict[int, str]) -> Verdict | None:
        if len(events) < 3:  # with two ranks the median rank is the mean: a pair has no majority
            return None
        compute = {e.rank: max(e.step_time_s - e.comm_time_s, 0.0) for e in events}
        typical = statistics.median(compute.values())
        if typical <= 0:
            return None
        for rank, c in compute.items():
            self._relative.setdefault(rank, deque(maxlen=self.window)).append(c / typical)
        scores = {r: statistics.median(q) for r, q in self._relative.items() if len(q) == self.window}
        rearm = 1.0 + self.threshold / 2
        self.reported = {
            r: n + 1 for r, n in self.reported.items() if n < self.window or scores.get(r, math.inf) >= rearm
        }
        candidates = [r for r in scores if r not in self.reported]
        if not candidates:
            return None
        rank = max(candidates, key=lambda r: (scores[r], -r))
        score = scores[rank]
        # a few milliseconds of a very short step are jitter, however large a share of it
        if score <= 1.0 + self.threshold or (score - 1.0) * typical < SCORE_MIN_S:
            return None
        self.reported[rank] = 0
        step = events[0].step
        node = nodes.get(rank, next((e.node for e in events if e.rank == rank), None))
        return Verdict(
            kind="imbalance",
            step=step,
            rank=rank,
            node=node,
            message=f"imbalance at step {step}: rank {rank} on {node} is the straggler (its compute "
            f"is {score - 1.0:.0%} above the median rank's over {self.window} steps, threshold "
            f"{self.threshold:.0%})",
            evidence={
                "score": round(score, 4),
                "scores": {str(r): round(v, 4) for r, v in sorted(scores.items())},
                "window": self.window,
                "threshold": self.threshold,
                "compute_s": typical,
            },
        )

    def mark(self, rank: int) -> None:
        """`rank` was reported slow by another detector: not again from its score until it recovers."""
        self.reported[rank] = 0

    def reset(self) -> None:
        self._relative.clear()
        self.reported.clear()
