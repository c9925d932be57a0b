"""Hang: a running job from which some rank has sent no step for too long, a launched job one of
whose ranks never started, or a rollback that never completes. `hang` measures one set of waits;
`job_hang` holds the rules for which waits a job has (called on a timer)."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable, Mapping

from vigil.jobstates import JobState
from vigil_guardian.state import Control
from vigil_guardian.verdict import Verdict


def p99(samples: Iterable[float]) -> float | None:
    """The 99th percentile (nearest rank) of `samples`; None when there are none. Under 100 samples it is
    the largest: a rare slow step (a checkpoint save every 20 steps) counts until the window holds
    enough steps to say how rare it is."""
    ordered = sorted(samples)
    if not ordered:
        return None
    return ordered[max(0, math.ceil(0.99 * len(ordered)) - 1)]


def hang_limit(p99_step_s: float | None, *, timeout_s: float, multiple: float, floor_s: float) -> float:
    """Seconds of silence that make a hang: `multiple` (k) x the p99 step time, never under `floor_s`,
    never over `timeout_s`; `timeout_s` alone before any step time is known.

    The detection target follows: a hang is judged within max(k x p99, floor) (capped by the timeout)
    plus the check's period (`vigil_guardian.service.HANG_CHECK_S`)."""
    if p99_step_s is None:
        return timeout_s
    return min(timeout_s, max(multiple * p99_step_s, floor_s))


def hang(
    now: float,
    progress: Mapping[int, tuple[float, int | None]],
    p99_step_s: float | None,
    *,
    timeout_s: float,
    multiple: float,
    floor_s: float,
    nodes: Mapping[int, str],
) -> Verdict | None:
    """The rank silent the longest, if it has been silent past the limit.

    Args:
        now: the current time (epoch seconds).
        progress: rank -> (time of its last step, or of the start of the wait; its last step or None).
        p99_step_s: the job's p99 step time over its window, None before any step.
    """
    if not progress:
        return None
    limit = hang_limit(p99_step_s, timeout_s=timeout_s, multiple=multiple, floor_s=floor_s)
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
            "p99_step_s": p99_step_s,
            "last_step": last_step,
            "last_steps": {str(r): p[1] for r, p in sorted(progress.items())},
        },
    )


# --- the rules: which ranks are waited for, since when, against which limit -------------------------


def running(c: Control, progress: Mapping[int, tuple[float, int | None]]) -> bool:
    """Is the job meant to be making steps now? The scheduler's word, else inferred from the ranks."""
    if c.state == JobState.RUNNING:
        return True
    if c.state is not None and c.state != JobState.SCHEDULED:
        return False
    return c.world_size is not None and (len(c.started) >= c.world_size or bool(progress))


def job_hang(
    c: Control, progress: Mapping[int, tuple[float, int | None]], p99_step_s: float | None, now: float
) -> Verdict | None:
    """A hang verdict for a job, or None. Three waits can hang:

    - a rollback in progress that has not completed within `hang_timeout_s` (loading a checkpoint
      takes what it takes, whatever the step time: the plain timeout only);
    - a running job's rank with no step for too long: `hang_step_multiple` (k) x the job's p99 step
      time, at least `hang_floor_s`, at most `hang_timeout_s`; once every rank has made the job's last
      step, the plain timeout only (final saves, leaving the process group and exiting are not steps);
    - a launched job's rank that never started, counted from the launch of this attempt, not
      from the attempt's first event: a job waits in the queue with its attempt already numbered,
      and that wait is no silence (plain timeout; none before the launch is seen).
    """
    ranks = c.live_ranks
    if c.terminal or not ranks:
        return None
    rec = c.recovering
    if rec is not None:
        if rec.kind != "rollback":
            return None
        waits = {r: (rec.since, rec.to_step - 1 if rec.to_step else None) for r in ranks}
        p99_step_s = None
    elif running(c, progress):
        start = c.running_since or c.launched_at or now
        waits = {r: progress.get(r, (start, None)) for r in ranks}
        if c.final_step is not None and all(s is not None and s >= c.final_step for _, s in waits.values()):
            p99_step_s = None
    elif c.state in (None, JobState.SCHEDULED) and c.launched_at is not None:
        waits = {r: (c.launched_at, None) for r in ranks if r not in c.started}
        p99_step_s = None
    else:
        return None
    v = hang(
        now,
        waits,
        p99_step_s,
        timeout_s=c.spec.hang_timeout_s,
        multiple=c.spec.hang_step_multiple,
        floor_s=c.spec.hang_floor,
        nodes=c.nodes,
    )
    if v is None:
        return None
    since = round(waits[v.rank or 0][0], 3)
    silent, limit = v.evidence["silent_s"], v.evidence["limit_s"]
    if rec is not None:
        return dataclasses.replace(
            v,
            message=f"hang: the rollback to step {rec.to_step} has not completed after "
            f"{silent:.1f}s (limit {limit:.1f}s)",
            evidence={**v.evidence, "rollback_to": rec.to_step, "since": since},
        )
    if not running(c, progress):
        waiting = sorted(waits)
        return dataclasses.replace(
            v,
            message=f"hang: rank {v.rank} on {v.node} has not started {silent:.1f}s "
            f"after the launch (limit {limit:.1f}s; not started: {waiting})",
            evidence={**v.evidence, "not_started": waiting, "since": since},
        )
    return dataclasses.replace(v, evidence={**v.evidence, "since": since})
