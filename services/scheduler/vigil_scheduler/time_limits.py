"""Time limits (`scheduling.time_limit`; the operator's `VIGIL_TIME_LIMIT_DEFAULT_S` and `_MAX_S`).

- At submission (`vigil_scheduler.admission`): a spec asking for more than the maximum is a 422 naming
  `scheduling.time_limit`.
- While it runs (`overdue`, read by the scheduler's sweeper, `Outcomes.stop_overdue`): an attempt whose ranks
  started longer ago than its limit is stopped as Slurm does at a job's limit: the same notice as a
  preemption (`PreemptJob` kind `time_limit`), the grace period, the emergency checkpoint.
- When its ranks have exited (`at_limit`): the job ends FAILED, not requeued, with a cause naming the limit
  and the checkpoint the user can resume from.
"""

from __future__ import annotations

import asyncpg

from vigil.spec_scheduling import format_duration
from vigil_scheduler.lifecycle import Job
from vigil_scheduler.states import JobEvent

# The attempt's limit: the spec's, else the operator's default (NULL: none).
_LIMIT = "COALESCE((j.spec->'scheduling'->>'time_limit')::float8, $1::float8)"


def limit_of(job: Job, default_s: float | None) -> tuple[float | None, str]:
    """The job's attempt limit in seconds (None: none), and where it comes from."""
    limit = (job.spec.get("scheduling") or {}).get("time_limit")
    if limit is not None:
        return float(limit), "scheduling.time_limit"
    return default_s, "VIGIL_TIME_LIMIT_DEFAULT_S"


async def overdue(conn: asyncpg.Connection, default_s: float | None, job_id: str | None = None) -> list[str]:
    """The running jobs whose current attempt's ranks started longer ago than its limit, and that are not
    being stopped already (only `job_id`, when given)."""
    rows = await conn.fetch(
        f"""SELECT j.id FROM jobs j
            WHERE j.state = 'RUNNING' AND NOT j.queued AND {_LIMIT} IS NOT NULL
              AND ($2::text IS NULL OR j.id = $2)
              AND NOT EXISTS (SELECT 1 FROM job_stops s WHERE s.job_id = j.id AND s.attempt = j.attempt)
              AND (SELECT min(r.started_at) FROM job_ranks r WHERE r.job_id = j.id AND r.attempt = j.attempt)
                  < now() - make_interval(secs => {_LIMIT})
            ORDER BY j.id LIMIT 100""",
        default_s,
        job_id,
    )
    return [r["id"] for r in rows]


def notice(job: Job, default_s: float | None) -> str:
    """The stop's reason: which limit the attempt ran past."""
    limit, source = limit_of(job, default_s)
    assert limit is not None
    return f"time limit {format_duration(limit)} ({source}) reached by attempt {job.attempt}"


async def at_limit(conn: asyncpg.Connection, job: Job, rank: int, reason: str) -> tuple[JobEvent, str]:
    """What the exit of `rank` (recorded) of an attempt stopped at its limit means: a sibling still to exit
    (RANK_STOPPED), or every rank out (ALL_STOPPED, with the cause the job ends FAILED with)."""
    exited = await conn.fetchval(
        "SELECT count(*) FROM job_ranks WHERE job_id = $1 AND attempt = $2 AND exited_at IS NOT NULL",
        job.id,
        job.attempt,
    )
    if exited < job.attempt_world_size:
        return JobEvent.RANK_STOPPED, f"rank {rank} exited at the time limit"
    row = await conn.fetchrow(
        """SELECT step, path, attempt = $2 AS now FROM scheduler_checkpoints WHERE job_id = $1 AND valid
           ORDER BY step DESC LIMIT 1""",
        job.id,
        job.attempt,
    )
    if row is None:
        kept = "no checkpoint was written"
    elif row["now"]:
        kept = f"emergency checkpoint of step {row['step']}: {row['path']} (resume from it)"
    else:
        kept = f"no emergency checkpoint in the grace period; the newest is step {row['step']}: {row['path']}"
    return JobEvent.ALL_STOPPED, f"{reason}: its ranks were stopped after the grace period; {kept}"
