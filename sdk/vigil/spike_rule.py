"""The loss-spike rule, one implementation for the guardian and the ranks.

A rank's loss spikes when it is far above the rolling median of that rank's previous finite losses:
a robust z-score, (loss - median) / (1.4826 * MAD), over the last `spike_window` losses, above the
spec's `spike_zscore`, once `spike_warmup` losses are in, and sudden (it also stands out from the
median of the rank's last few losses, so a steady climb is left to the divergence test). The spread is
floored relative to the median and by the other ranks' spread (they see the same noise; a short window
can badly underestimate one rank's).

The guardian judges every reported step with it after the fact; the ranks judge the same numbers at
the step boundary, before the optimizer step, from the losses the boundary all-reduce gave every rank,
so that all ranks hold a bad update together (`LossWindows` is the state both keep). Pure: no I/O.
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from collections.abc import Sequence
from typing import NamedTuple

# 1.4826 * MAD estimates the standard deviation of normally distributed values.
MAD_TO_SIGMA = 1.4826
# A floor under the spread, relative to the median: on a very smooth series a tiny MAD would
# turn noise of a few percent into huge z-scores. With z = 6 a spike must be >= 12 % above the median.
REL_SCALE_FLOOR = 0.02
ABS_SCALE_FLOOR = 1e-8
# A spike is sudden: the value must also stand out (by half the threshold) from the median of the
# rank's last few values, so a loss that climbs a few percent a step is left to the divergence test.
SUDDEN_OVER = 3


class SpikeScore(NamedTuple):
    """A loss judged a spike: its robust z-score against the window, and the window's median and MAD."""

    zscore: float
    median: float
    mad: float
    window: int


def scale(median: float, mad: float, floor: float = 0.0) -> float:
    """The robust spread: 1.4826 * MAD, floored (relative to the median, absolutely, and by `floor`)."""
    return max(MAD_TO_SIGMA * mad, REL_SCALE_FLOOR * abs(median), ABS_SCALE_FLOOR, floor)


def robust_z(history: Sequence[float], value: float, floor: float = 0.0) -> tuple[float, float, float]:
    """(z, median, mad) of `value` against `history`: (value - median) / (1.4826 * MAD), floored
    (relative to the median, and by `floor`)."""
    median = statistics.median(history)
    mad = statistics.median([abs(x - median) for x in history])
    return (value - median) / scale(median, mad, floor), median, mad


def relative_spread(history: Sequence[float]) -> float | None:
    """The robust spread of `history` relative to its median (1.4826 * MAD / median)."""
    if not history:
        return None
    median = statistics.median(history)
    mad = statistics.median([abs(x - median) for x in history])
    return MAD_TO_SIGMA * mad / max(abs(median), ABS_SCALE_FLOOR)


def spike_score(
    history: Sequence[float], loss: float, *, zscore: float, warmup: int, peer_spread: float = 0.0
) -> SpikeScore | None:
    """The spike `loss` is against `history` (the rank's previous finite losses, oldest first), or None.

    Args:
        zscore: the threshold (GuardianSpec.spike_zscore).
        warmup: no verdict until the window holds at least this many values.
        peer_spread: the other ranks' relative spread (`relative_spread`), a floor under this rank's own.
    """
    if len(history) < warmup or not history or not math.isfinite(loss):
        return None
    floor = peer_spread * abs(statistics.median(history)) if peer_spread else 0.0
    z, median, mad = robust_z(history, loss, floor)
    if z <= zscore:
        return None
    recent = statistics.median(history[-SUDDEN_OVER:])
    if (loss - recent) / scale(median, mad, floor) <= zscore / 2:
        return None  # a climb, not a jump: divergence's business
    return SpikeScore(z, median, mad, len(history))


class LossWindows:
    """Per rank, its recent finite losses (step, loss) and the relative spread of its window: what a new
    loss is judged against. `judge` changes nothing; `add` takes a loss into the window."""

    def __init__(self, window: int, warmup: int) -> None:
        self.losses: dict[int, deque[tuple[int, float]]] = {}
        self.spreads: dict[int, float] = {}
        self.resize(window, warmup)

    def resize(self, window: int, warmup: int) -> None:
        self.window, self.warmup = window, warmup
        self.losses = {r: deque(s, maxlen=window) for r, s in self.losses.items()}

    def history(self, rank: int) -> list[float]:
        return [x for _, x in self.losses.get(rank, ())]

    def judge(self, rank: int, loss: float, zscore: float) -> SpikeScore | None:
        """Is `loss` a spike for `rank`, against its window and its peers' spread?"""
        peers = [v for r, v in self.spreads.items() if r != rank]
        return spike_score(
            self.history(rank),
            loss,
            zscore=zscore,
            warmup=self.warmup,
            peer_spread=statistics.median(peers) if peers else 0.0,
        )

    def add(self, rank: int, step: int, loss: float) -> None:
        """Take a finite loss into the rank's window (a non-finite one is left out)."""
        if not math.isfinite(loss):
            return
        series = self.losses.setdefault(rank, deque(maxlen=self.window))
        series.append((step, loss))
        if len(series) >= self.warmup:
            self.spreads[rank] = relative_spread([x for _, x in series]) or 0.0

    def rewind(self, to_step: int) -> None:
        """A rollback to `to_step`: forget the losses of steps from there on."""
        for rank, series in self.losses.items():
            self.losses[rank] = deque(((s, x) for s, x in series if s < to_step), maxlen=self.window)
