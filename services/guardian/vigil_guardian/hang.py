"""Hang: a running job from which some rank has sent no step for too long, or a launched job one of
whose ranks never started."""

from __future__ import annotations

from collections.abc import Mapping

from vigil_guardian.verdict import Verdict

# The step-time multiple never judges a silence shorter than this a hang: a checkpoint save or an
# evaluation can take many times a sub-second step.
MIN_HANG_S = 5.0


def hang_limit(median_step_s: float | None, *, timeout_s: float, multiple: float) -> float:
    """Seconds of silence that make a hang: `timeout_s`, or `multiple` median steps if that is sooner."""
    if median_step_s is None:
        return timeout_s
    return min(timeout_s, max(multiple * median_step_s, MIN_HANG_S))


def hang(
    now: float,
    progress: Mapping[int, tuple[float, int | None]],
    median_step_s: float | None,
    *,
    timeout_s: float,
    multiple: float,
    nodes: Mapping[int, str],
) -> Verdict | None:
    """The rank silent the longest, if it has been silent past the limit.

    Args:
        now: the current time (epoch seconds).
        progress: rank -> (time of its last step, or of the start of the wait; its last step or None).
        median_step_s: the job's median step time, None before any step.
    """
    if not progress:
        return None
    limit = hang_limit(median_step_s, timeout_s=timeout_s, multiple=multiple)
    rank = min(progress, key=lambda r: (progress[r][0], r))
    since, last_step = progress[rank]
    silent = now - since
    if silent <= limit:
        return None
    node = nodes.get(rank)
    return Verdict(
        kind="hang",
        step=None if last_step is None else last_step + 1,
        rank=rank,
        node=node,
        message=f"hang: no step from rank {rank} on {node} for {silent:.1f}s (limit {limit:.1f}s; "
        + (f"last step {last_step})" if last_step is not None else "no step yet)"),
        evidence={
            "silent_s": round(silent, 3),
            "limit_s": limit,
            "median_step_s": median_step_s,
            "last_step": last_step,
            "last_steps": {str(r): p[1] for r, p in sorted(progress.items())},
        },
    )
