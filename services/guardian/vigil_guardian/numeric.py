"""Detectors on a rank's numbers: non-finite values, loss spikes, divergence.

Each is a pure function of a window of values and returns a `Verdict` or None.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence

from vigil_common.events import StepCompleted
from vigil_guardian.verdict import Verdict

# 1.4826 * MAD estimates the standard deviation of normally distributed values.
MAD_TO_SIGMA = 1.4826
# A floor under the spread, relative to the median: on a very smooth series a tiny MAD would
# turn noise of a few percent into huge z-scores. With z = 6 a spike must be >= 12 % above the median.
REL_SCALE_FLOOR = 0.02
ABS_SCALE_FLOOR = 1e-8


def non_finite(event: StepCompleted) -> Verdict | None:
    """NaN or Inf in the loss or the gradient norm, or a step the rank skipped for non-finite grads."""
    bad = {
        name: value
        for name, value in (("loss", event.loss), ("grad_norm", event.grad_norm))
        if value is not None and not math.isfinite(value)
    }
    if not bad and not event.skipped:
        return None
    what = ", ".join(f"{k}={v}" for k, v in bad.items()) or "the update was skipped"
    return Verdict(
        kind="nan",
        step=event.step,
        rank=event.rank,
        node=event.node,
        message=f"non-finite values on rank {event.rank} at step {event.step}: {what}",
        evidence={
            "loss": _json_float(event.loss),
            "grad_norm": _json_float(event.grad_norm),
            "skipped": event.skipped,
            "data_position": event.data_position,
        },
    )


def robust_z(history: Sequence[float], value: float) -> tuple[float, float, float]:
    """(z, median, mad) of `value` against `history`: (value - median) / (1.4826 * MAD), floored."""
    median = statistics.median(history)
    mad = statistics.median([abs(x - median) for x in history])
    scale = max(MAD_TO_SIGMA * mad, REL_SCALE_FLOOR * abs(median), ABS_SCALE_FLOOR)
    return (value - median) / scale, median, mad


def spike(
    history: Sequence[float], loss: float, *, zscore: float, warmup: int, step: int, rank: int, node: str
) -> Verdict | None:
    """A loss far above the rolling median of the previous finite losses (robust z-score).

    Args:
        history: the rank's previous finite losses, oldest first (the rolling window).
        loss: this step's loss.
        zscore: the threshold (GuardianSpec.spike_zscore).
        warmup: no verdict until the window holds at least this many values.
    """
    if len(history) < warmup or not history or not math.isfinite(loss):
        return None
    z, median, mad = robust_z(history, loss)
    if z <= zscore:
        return None
    return Verdict(
        kind="spike",
        step=step,
        rank=rank,
        node=node,
        message=f"loss spike on rank {rank} at step {step}: {loss:.4g} vs median {median:.4g} (z={z:.1f})",
        evidence={
            "loss": loss,
            "median": median,
            "mad": mad,
            "zscore": z,
            "threshold": zscore,
            "window": len(history),
        },
    )


def smoothing_width(window: int) -> int:
    """How many steps the rolling median that smooths the loss spans, for a divergence window."""
    return max(3, window // 5)


def divergence(
    losses: Sequence[float], *, window: int, tolerance: float, step: int, rank: int, node: str
) -> Verdict | None:
    """The smoothed loss has risen by more than `tolerance` (relative) above its lowest point in the window.

    The loss is smoothed by a rolling median over `smoothing_width(window)` steps, so a single spike
    (the spike detector's business) never reads as divergence.

    Args:
        losses: the rank's finite losses, oldest first, ending with this step's; at least `window`
            values are needed (earlier values beyond `window + width` are ignored).
    """
    width = smoothing_width(window)
    if len(losses) < window:
        return None
    recent = list(losses[-(window + width - 1) :])
    smoothed = [statistics.median(recent[i - width + 1 : i + 1]) for i in range(width - 1, len(recent))]
    low = min(smoothed)
    now = smoothed[-1]
    rise = (now - low) / max(abs(low), ABS_SCALE_FLOOR)
    if rise <= tolerance:
        return None
    return Verdict(
        kind="divergence",
        step=step,
        rank=rank,
        node=node,
        message=f"loss diverging on rank {rank} at step {step}: smoothed {now:.4g} is {rise:.0%} above "
        f"its low {low:.4g} in the last {window} steps",
        evidence={
            "smoothed": now,
            "low": low,
            "rise": rise,
            "tolerance": tolerance,
            "window": window,
            "smoothing": width,
        },
    )


def _json_float(value: float | None) -> float | str | None:
    """Evidence is JSON: non-finite floats become the strings "NaN", "Infinity", "-Infinity"."""
    if value is None or math.isfinite(value):
        return value
    return "NaN" if math.isnan(value) else ("Infinity" if value > 0 else "-Infinity")
