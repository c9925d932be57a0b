"""Hang: a rank that has sent no step for too long. Four waits can hang, each with its own limit:

- **not started**: a launched rank whose process never started;
- **start-up**: a rank that has not made its first step of the attempt (imports, the process group,
  building the engine, loading the checkpoint, compiling the first step). Judged against the start-up
  limit (`startup_limit`), never against step times: a relaunch keeps the attempt before's step times,
  and k x a 0.1 s p99 once judged every relaunch's start-up hung after 5 s (issue 39);
- **step**: a rank past its first step: k x the job's p99 step time, between the floor and the timeout
  (`hang_limit`);
- **rollback**: a rollback that never completes (a load: the timeout, or the checkpoint's read time).

`hang` measures one set of waits against one limit; `job_hang` holds the rules for which waits a job has
(called on a timer).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable, Mapping, Sequence
from typing import Literal

from vigil.jobstates import JobState
from vigil.spec import CHECKPOINT_READ_BYTES_S, STARTUP_FLOOR_S, STARTUP_MULTIPLE, GuardianSpec
from vigil_guardian.state import Control
from vigil_guardian.verdict import Verdict

STARTUPS_KEPT = 5  # the recent attempts' start-ups the learned limit is taken over

Phase = Literal["not_started", "startup", "step", "rollback"]


@dataclasses.dataclass(frozen=True)
class Limit:
    """A limit in seconds and what set it, as an incident says it (the FAILED reason of a job that a
    hang ended names the limit, so a start-up judged too tightly reads as Vigil's fault, not the job's)."""

    seconds: float
    why: str


def p99(samples: Iterable[float]) -> float | None:
    """The 99th percentile (nearest rank) of `samples`; None when there are none. Under 100 samples it is
    the largest: a rare slow step (a checkpoint save every 20 steps) counts until the window holds
    enough steps to say how rare it is."""
    ordered = sorted(samples)
    if not ordered:
        return None
    return ordered[max(0, math.ceil(0.99 * len(ordered)) - 1)]


def hang_limit(p99_step_s: float | None, *, timeout_s: float, multiple: float, floor_s: float) -> float:
    """Seconds of silence after a step that make a hang: `multiple` (k) x the p99 step time, never under
    `floor_s`, never over `timeout_s`; `timeout_s` alone before any step time is known.

    The detection target follows: a hang is judged within max(k x p99, floor) (capped by the timeout)
    plus the check's period (`vigil_guardian.service.HANG_CHECK_S`)."""
    if p99_step_s is None:
        return timeout_s
    return min(timeout_s, max(multiple * p99_step_s, floor_s))


def step_limit(spec: GuardianSpec, p99_step_s: float | None) -> Limit:
    seconds = hang_limit(
        p99_step_s, timeout_s=spec.hang_timeout_s, multiple=spec.hang_step_multiple, floor_s=spec.hang_floor
    )
    if p99_step_s is None or seconds == spec.hang_timeout_s:
        return Limit(seconds, "guardian.hang_timeout_s")
    if seconds == spec.hang_floor:
        return Limit(seconds, "guardian.hang_floor_s")
    return Limit(seconds, f"{spec.hang_step_multiple:g} x the p99 step time, {p99_step_s:.3g}s")


def checkpoint_read_s(nbytes: int) -> float:
    """The longest a load of a checkpoint of `nbytes` is allowed before it could be hung: its read (and
    the manifest's hash of every byte) at `CHECKPOINT_READ_BYTES_S`."""
    return nbytes / CHECKPOINT_READ_BYTES_S


def _at_least_the_read(limit: Limit, checkpoint_bytes: int) -> Limit:
    read_s = checkpoint_read_s(checkpoint_bytes)
    if read_s <= limit.seconds:
        return limit
    rate = CHECKPOINT_READ_BYTES_S / 1e6
    return Limit(read_s, f"the read of its {checkpoint_bytes / 1e9:.1f} GB checkpoint at {rate:g} MB/s")


def startup_limit(spec: GuardianSpec, startups: Sequence[float], checkpoint_bytes: int) -> Limit:
    """How long an attempt's rank may take to its first step.

    `startup_timeout_s` until the job has measured a start-up; then learned: `STARTUP_MULTIPLE` x the
    longest of its recent start-ups, never under `STARTUP_FLOOR_S` (a warm first start-up, then a cold
    relaunch that imports torch again), never over the timeout. In either case, never under the time its
    largest checkpoint takes to read (`checkpoint_read_s`): a load Vigil's own manifest check makes that
    long is not a hang."""
    timeout = spec.startup_timeout_s
    limit = Limit(timeout, "guardian.startup_timeout_s")
    if startups:
        longest = max(startups)
        floor = min(STARTUP_FLOOR_S, timeout)
        learned = max(floor, STARTUP_MULTIPLE * longest)
        if learned < timeout:
            limit = Limit(
                learned,
                f"{STARTUP_MULTIPLE:g} x this job's longest start-up, {longest:.1f}s, at least {floor:g}s",
            )
    return _at_least_the_read(limit, checkpoint_bytes)


def rollback_limit(spec: GuardianSpec, checkpoint_bytes: int) -> Limit:
    """How long a rollback may take to complete: the plain timeout (a load takes what it takes, whatever
    the step time), never under the read of the checkpoint."""
    return _at_least_the_read(Limit(spec.hang_timeout_s, "guardian.hang_timeout_s"), checkpoint_bytes)


def hang(
    now: float,
    progress: Mapping[int, tuple[float, int | None]],
    limit: float,
    *,
    nodes: Mapping[int, str],
) -> Verdict | None:
    """The rank silent the longest, if it has been silent past `limit` seconds.

    Args:
        now: the current time (epoch seconds).
        progress: rank -> (time of its last step, or of the start of the wait; its last step or None).
    """
    if not progress:
        return None
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
    """A hang verdict for a job, or None. The waits (see the module's docstring):

    - a rollback in progress that has not completed within `rollback_limit`;
    - a running job's rank that has not made its first step of the attempt, counted from when the job
      began running (its ranks all started), within `startup_limit`;
    - a running job's rank past its first step: `step_limit` from its last step; once every rank has made
      the job's last step, the plain timeout only (final saves, leaving the process group and exiting are
      not steps);
    - a launched job's rank that never started, counted from the launch of this attempt, not from the
      attempt's first event: a job waits in the queue with its attempt already numbered, and that wait is
      no silence (`startup_limit`; none before the launch is seen).
    """
    ranks = c.live_ranks
    if c.terminal or not ranks:
        return None
    spec, rec = c.spec, c.recovering
    if rec is not None:
        if rec.kind != "rollback":
            return None
        waits = {r: (rec.since, rec.to_step - 1 if rec.to_step else None) for r in ranks}
        return _judged("rollback", now, waits, rollback_limit(spec, c.checkpoint_bytes), c)
    if running(c, progress):
        # the phase is the saved control state's (`Control.stepped`); the times are the windows'
        start = c.running_since or c.launched_at or now
        starting = {r: (start, None) for r in ranks if r not in c.stepped}
        v = _judged("startup", now, starting, startup_limit(spec, c.startups, c.checkpoint_bytes), c)
        if v is not None:
            return v
        stepped = {r: progress.get(r, (start, None)) for r in ranks if r in c.stepped}
        done = c.final_step is not None and not starting
        if done and all(s is not None and s >= (c.final_step or 0) for _, s in stepped.values()):
            p99_step_s = None
        return _judged("step", now, stepped, step_limit(spec, p99_step_s), c, p99_step_s=p99_step_s)
    if c.state in (None, JobState.SCHEDULED) and c.launched_at is not None:
        waits = {r: (c.launched_at, None) for r in ranks if r not in c.started}
        return _judged("not_started", now, waits, startup_limit(spec, c.startups, c.checkpoint_bytes), c)
    return None


def _judged(
    phase: Phase,
    now: float,
    waits: Mapping[int, tuple[float, int | None]],
    limit: Limit,
    c: Control,
    *,
    p99_step_s: float | None = None,
) -> Verdict | None:
    """`hang` on one phase's waits, its message and evidence saying which wait and which limit."""
    v = hang(now, waits, limit.seconds, nodes=c.nodes)
    if v is None:
        return None
    since = round(waits[v.rank or 0][0], 3)
    silent = v.evidence["silent_s"]
    within = f"{limit.seconds:.1f}s: {limit.why}"
    evidence = {**v.evidence, "since": since, "phase": phase, "limit": limit.why, "p99_step_s": p99_step_s}
    match phase:
        case "rollback":
            rec = c.recovering
            assert rec is not None
            message = (
                f"hang: the rollback to step {rec.to_step} has not completed after {silent:.1f}s "
                f"(limit {within})"
            )
            evidence["rollback_to"] = rec.to_step
        case "not_started":
            waiting = sorted(waits)
            message = (
                f"hang: rank {v.rank} on {v.node} has not started {silent:.1f}s after the launch "
                f"(start-up limit {within}; not started: {waiting})"
            )
            evidence["not_started"] = waiting
        case "startup":
            message = (
                f"hang: rank {v.rank} on {v.node} never reached its first step in {silent:.1f}s "
                f"(start-up limit {within})"
            )
            evidence["starting"] = sorted(waits)
        case "step":
            last = v.evidence["last_step"]
            message = (
                f"hang: no step from rank {v.rank} on {v.node} for {silent:.1f}s (step limit {within}; "
                + (f"last step {last})" if last is not None else "no step since the wait began)")
            )
    return dataclasses.replace(v, message=message, evidence=evidence)
