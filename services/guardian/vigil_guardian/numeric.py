"""Detectors on the numbers of a step: non-finite values, loss and gradient-norm spikes, divergence.

Each is a pure function of a window of values and returns a `Verdict` or None. A loss spike is judged
per rank (a bad batch is one rank's); the gradient norm is one global value per step (it is
all-reduced), and divergence is judged on the step's cross-rank median loss, which is steadier than
any one rank's and blind to a single rank's spike.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence

from vigil.events import StepCompleted
from vigil_common.spike_rule import ABS_SCALE_FLOOR, MAD_TO_SIGMA, SpikeScore, spike_score
from vigil_guardian.verdict import Verdict

# The gradient norm wanders by 2-3x in healthy training; an explosion is this many times its median
# (and a robust outlier in log space, whose spread is floored at GRAD_LOG_SCALE_FLOOR).
GRAD_SPIKE_RATIO = 8.0
GRAD_LOG_SCALE_FLOOR = 0.1
# Divergence: the least-squares trend of log(loss) over the window must be this many standard
# errors above flat (as well as rising more than the tolerance across the window).
DIVERGENCE_T = 6.0
LONG_WINDOWS = 4  # the trend is also fitted over this many windows, which sees a slow rise sooner


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


def spike(
    history: Sequence[float],
    loss: float,
    *,
    zscore: float,
    warmup: int,
    step: int,
    rank: int,
    node: str,
    peer_spread: float = 0.0,
) -> Verdict | None:
    """A loss far above the rolling median of the previous finite losses (robust z-score).

    Args:
        history: the rank's previous finite losses, oldest first (the rolling window).
        loss: this step's loss.
        zscore: the threshold (GuardianSpec.spike_zscore).
        warmup: no verdict until the window holds at least this many values.
        peer_spread: the other ranks' relative spread (`relative_spread`): a floor under this rank's
            own, which a short window can badly underestimate (the ranks see the same noise).
    """
    found = spike_score(history, loss, zscore=zscore, warmup=warmup, peer_spread=peer_spread)
    return spike_verdict(found, loss, zscore, step, rank, node)


def spike_verdict(
    found: SpikeScore | None, loss: float, zscore: float, step: int, rank: int, node: str | None
) -> Verdict | None:
    """The verdict on a loss the spike rule (`vigil_common.spike_rule`) scored, or None."""
    if found is None:
        return None
    z, median, mad, window = found
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
            "window": window,
        },
    )


def grad_spike(
    history: Sequence[float], grad_norm: float, *, zscore: float, warmup: int, step: int
) -> Verdict | None:
    """A gradient norm that exploded: `GRAD_SPIKE_RATIO` times the rolling median of the previous
    finite norms and a robust outlier (z > `zscore`) in log space. It often precedes a loss spike.

    Args:
        history: the job's previous finite gradient norms (one per step), oldest first.
    """
    if len(history) < warmup or not math.isfinite(grad_norm) or grad_norm <= 0:
        return None
    logs = [math.log(x) for x in history if x > 0]
    if not logs:
        return None
    median = statistics.median(logs)
    mad = statistics.median([abs(x - median) for x in logs])
    z = (math.log(grad_norm) - median) / max(MAD_TO_SIGMA * mad, GRAD_LOG_SCALE_FLOOR)
    ratio = grad_norm / math.exp(median)
    if ratio < GRAD_SPIKE_RATIO or z <= zscore:
        return None
    return Verdict(
        kind="spike",
        step=step,
        message=f"gradient norm spike at step {step}: {grad_norm:.4g} is {ratio:.0f}x its median "
        f"{math.exp(median):.4g} (z={z:.1f} in log space)",
        evidence={
            "grad_norm": grad_norm,
            "median": math.exp(median),
            "ratio": ratio,
            "zscore": z,
            "threshold": zscore,
            "window": len(history),
        },
    )


def trend(values: Sequence[float]) -> tuple[float, float]:
    """(slope per step, its standard error) of the least-squares line through `values` (>= 3)."""
    n = len(values)
    mx = (n - 1) / 2
    my = sum(values) / n
    sxx = n * (n * n - 1) / 12
    slope = sum((i - mx) * (y - my) for i, y in enumerate(values)) / sxx
    resid = sum((y - my - slope * (i - mx)) ** 2 for i, y in enumerate(values))
    se = math.sqrt(resid / (n - 2) / sxx) if n > 2 else math.inf
    return slope, max(se, ABS_SCALE_FLOOR)


def divergence(
    losses: Sequence[float],
    *,
    window: int,
    tolerance: float,
    step: int,
    rank: int | None = None,
    node: str | None = None,
) -> Verdict | None:
    """The loss trends upward: a trend test on log(loss), over the last `window` values and over
    `LONG_WINDOWS` windows (a slow rise shows there first).

    It is divergence when the fitted line rises by more than `tolerance` (relative) across its span
    and its slope is `DIVERGENCE_T` standard errors above flat. A single spike barely moves the
    line and inflates its error; a benign shift of a few percent (a data-mix change) rises too little.

    Args:
        losses: finite losses, oldest first, ending with this step's (for the job: each step's
            cross-rank median); at least `window` values are needed.
    """
    for span in (window, LONG_WINDOWS * window):
        if len(losses) < span:
            return None
        ys = [math.log(max(x, ABS_SCALE_FLOOR)) for x in losses[-span:]]
        slope, se = trend(ys)
        rise = math.exp(slope * (span - 1)) - 1.0
        t = slope / se
        if rise > tolerance and t > DIVERGENCE_T:
            where = f" on rank {rank}" if rank is not None else ""
            return Verdict(
                kind="divergence",
                step=step,
                rank=rank,
                node=node,
                message=f"loss diverging{where} at step {step}: its trend rose {rise:.0%} over the last "
                f"{span} steps ({slope:.2%} per step, t={t:.1f})",
                evidence={
                    "rise": rise,
                    "slope_per_step": slope,
                    "t": t,
                    "tolerance": tolerance,
                    "window": span,
                    "latest": losses[-1],
                },
            )
    return None


def _json_float(value: float | None) -> float | str | None:
    """Evidence is JSON: non-finite floats become the strings "NaN", "Infinity", "-Infinity"."""
    if value is None or math.isfinite(value):
        return value
    return "NaN" if math.isnan(value) else ("Infinity" if value > 0 else "-Infinity")
