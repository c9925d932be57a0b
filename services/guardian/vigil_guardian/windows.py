"""The detectors' state for one timeline of a job: what a new step is judged against.

Per rank, the recent finite losses (spike and divergence windows) and its last step; per job, the
steps not yet reported by every rank (the imbalance detector needs all of a step's events), the
run of imbalanced steps, and recent step times (the hang detector's median). Pure: no I/O.
"""

from __future__ import annotations

import math
import statistics
from collections import deque

from vigil_common.events import StepCompleted
from vigil_common.spec import GuardianSpec
from vigil_guardian import numeric
from vigil_guardian.collective import ImbalanceTracker
from vigil_guardian.verdict import Verdict

PENDING_MAX = 64  # incomplete steps kept for the imbalance detector


class Windows:
    def __init__(self, spec: GuardianSpec) -> None:
        self.losses: dict[int, deque[tuple[int, float]]] = {}  # rank -> (step, loss), oldest first
        self.pending: dict[int, dict[int, StepCompleted]] = {}  # step -> rank -> event
        self.step_times: deque[float] = deque(maxlen=101)
        self.progress: dict[int, tuple[float, int | None]] = {}  # rank -> (time of its last step, step)
        self.resize(spec)

    def resize(self, spec: GuardianSpec) -> None:
        """Apply a (new) policy's window sizes and thresholds, keeping what has been seen."""
        self.spec = spec
        self.keep = max(
            spec.spike_window, spec.divergence_window + numeric.smoothing_width(spec.divergence_window)
        )
        self.losses = {r: deque(s, maxlen=self.keep) for r, s in self.losses.items()}
        self.tracker = ImbalanceTracker(spec.imbalance_threshold, spec.imbalance_steps)

    def median_step_s(self) -> float | None:
        return statistics.median(self.step_times) if self.step_times else None

    def observe(self, event: StepCompleted, world_size: int | None, nodes: dict[int, str]) -> list[Verdict]:
        """Add one rank's step; the verdicts it brings: at most one numeric, and a collective one for
        each complete step judged now."""
        spec, rank, step = self.spec, event.rank, event.step
        self.progress[rank] = (event.occurred_at.timestamp(), step)
        if math.isfinite(event.step_time_s) and event.step_time_s > 0:
            self.step_times.append(event.step_time_s)

        verdict = numeric.non_finite(event)
        if verdict is None:
            series = self.losses.setdefault(rank, deque(maxlen=self.keep))
            history = [x for _, x in series][-spec.spike_window :]
            verdict = numeric.spike(
                history,
                event.loss,
                zscore=spec.spike_zscore,
                warmup=spec.spike_warmup,
                step=step,
                rank=rank,
                node=event.node,
            )
            series.append((step, event.loss))
            if verdict is None:
                verdict = numeric.divergence(
                    [x for _, x in series],
                    window=spec.divergence_window,
                    tolerance=spec.divergence_tolerance,
                    step=step,
                    rank=rank,
                    node=event.node,
                )
        verdicts = [verdict] if verdict else []

        # Held even before the world size is known (a launch can be judged after the first steps):
        # every step complete by then is judged, in order, as soon as it is.
        self.pending.setdefault(step, {})[rank] = event
        if world_size and world_size >= 2:
            for s in sorted(self.pending):
                group = self.pending.get(s)
                if group is None or len(group) < world_size:
                    continue
                for older in [o for o in self.pending if o <= s]:  # incomplete older steps: given up
                    del self.pending[older]
                if found := self.tracker.observe(list(group.values()), nodes):
                    verdicts.append(found)
        while len(self.pending) > PENDING_MAX:
            del self.pending[min(self.pending)]
        return verdicts

    def rewind(self, to_step: int, at: float, ranks: list[int]) -> None:
        """A rollback to checkpoint `to_step` at time `at`: forget the steps from `to_step` on."""
        for rank, series in self.losses.items():
            self.losses[rank] = deque(((s, x) for s, x in series if s < to_step), maxlen=self.keep)
        self.pending.clear()
        self.tracker.reset()
        self.progress = {r: (at, to_step - 1 if to_step else None) for r in ranks}
