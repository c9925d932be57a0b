"""Job state changes in Postgres. Each one, in the caller's transaction: the job row, a
`job_transitions` row with its cause, a `JobStateChanged` in the outbox, and the devices released
when the new state holds none. Callers lock the job first with `lock_job`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import asyncpg

from vigil.events import CancelJob, IncidentRaised, JobStateChanged
from vigil.jobstates import JobState
from vigil.spec import JobSpec
from vigil_common import subjects
from vigil_scheduler import outbox, states

JOB_COLUMNS = """id, seq, name, state, priority, spec, world_size, max_nodes, attempt, queued, placement,
    previous_placement, master_addr, master_port, resume_from, skip_data, reason, completed_commands,
    trace_context, created_at, updated_at, finished_at, owner, team, queue_reason, progress_at, recovery,
    recovery_incidents"""

# The cause of the transition that ends an elastic job's shrunk attempt to place it at its whole size again
# (`Outcome.GROW`) starts with this: such an attempt, like a preempted one, did not fail, and does not count
# against VIGIL_MAX_ATTEMPTS.
GROW_BACK = "grow back"


@dataclass(frozen=True)
class Job:
    id: str
    seq: int
    name: str
    state: JobState
    priority: int
    spec: dict[str, Any]
    world_size: int
    max_nodes: int
    attempt: int
    # Waiting for a placement of `attempt`: not ended, and no placement yet (a new or requeued
    # job, PENDING; or a restart, ROLLING_BACK, whose ranks are relaunched once placed). The state
    # alone cannot tell (ROLLING_BACK is also an in-place rollback on placed ranks), so it is a
    # stored column, indexed for the placement pass, and set only by `transition` (and the
    # column's default for a new job), from the state and the placement.
    queued: bool
    placement: list[dict[str, Any]] | None
    previous_placement: list[dict[str, Any]] | None
    master_addr: str | None
    master_port: int | None
    resume_from: str | None
    skip_data: list[int] | None
    reason: str | None
    completed_commands: list[str]
    trace_context: dict[str, str]
    created_at: datetime
    updated_at: datetime
    finished_at: datetime | None
    owner: str  # the user who submitted it (`principals`): it and its team see it, and admins
    team: str | None
    queue_reason: str | None  # why a queued job waits, when not for devices (a quota)
    progress_at: datetime  # its last transition or rank event: the sweeper's clock (`recovery`)
    # The HaltJob and RollbackJob the current attempt is under: {"halt": {...}, "rollback": {...},
    # "halted_step": n}; None when none. Cleared when the job runs again, ends, or starts an attempt.
    recovery: dict[str, Any] | None
    # The incidents behind its halts and rollbacks: id -> the bad step's update was never applied.
    recovery_incidents: dict[str, bool]

    @classmethod
    def from_row(cls, row: asyncpg.Record) -> Job:
        data = dict(row)
        data["state"] = JobState(data["state"])
        json_columns = ("spec", "placement", "previous_placement", "trace_context", "recovery")
        for key in (*json_columns, "recovery_incidents"):
            if isinstance(data[key], str):
                data[key] = json.loads(data[key])
        data["skip_data"] = list(data["skip_data"]) if data["skip_data"] is not None else None
        data["completed_commands"] = list(data["completed_commands"])
        return cls(**data)

    @property
    def terminal(self) -> bool:
        return states.is_terminal(self.state)

    @property
    def attempt_world_size(self) -> int:
        """The current attempt's ranks: its placement's once placed (fewer than `world_size`, what the job
        asks for, when an elastic job continues on fewer nodes); before, `world_size`."""
        return len(self.placement) if self.placement else self.world_size


async def insert_job(
    conn: asyncpg.Connection,
    job_id: str,
    spec: JobSpec,
    trace_context: dict[str, str],
    *,
    owner: str,
    team: str | None,
) -> Job:
    """Store a new PENDING job (queued for placement) of `owner` and its first transition."""
    row = await conn.fetchrow(
        f"""INSERT INTO jobs (id, name, state, priority, spec, world_size, max_nodes, trace_context, owner,
                team)
            VALUES ($1, $2, $8, $3, $4, $5, $6, $7, $9, $10) RETURNING {JOB_COLUMNS}""",
        job_id,
        spec.name,
        spec.priority,
        spec.model_dump_json(),
        spec.resources.world_size,
        spec.resources.nodes,
        json.dumps(trace_context),
        JobState.PENDING,
        owner,
        team,
    )
    job = Job.from_row(row)
    await _record(conn, job, None, JobState.PENDING, "submitted")
    return job


async def get_job(conn: asyncpg.Connection, job_id: str) -> Job | None:
    row = await conn.fetchrow(f"SELECT {JOB_COLUMNS} FROM jobs WHERE id = $1", job_id)
    return Job.from_row(row) if row else None


async def lock_job(conn: asyncpg.Connection, job_id: str | None) -> Job | None:
    """The job row, locked until the transaction ends (None when there is no such job)."""
    if job_id is None:
        return None
    row = await conn.fetchrow(f"SELECT {JOB_COLUMNS} FROM jobs WHERE id = $1 FOR UPDATE", job_id)
    return Job.from_row(row) if row else None


async def transition(
    conn: asyncpg.Connection, job: Job, to_state: JobState, cause: str, **updates: Any
) -> Job:
    """Move `job` to `to_state` with `cause`; `updates` are other job columns to set at the same time.
    `queued` follows: true while the job is not ended and has no placement (see `Job.queued`); the
    recovery under way is forgotten when the job runs again, ends, or starts another attempt.

    Raises Conflict when the state machine does not allow the move.
    """
    states.check(job.id, job.state, to_state)
    placement = updates.get("placement", job.placement)
    values: dict[str, Any] = {
        "state": to_state,
        **updates,
        "queued": placement is None and not states.is_terminal(to_state),
    }
    if not values["queued"]:
        values["queue_reason"] = None  # placed or ended: it waits for nothing
    if "recovery" not in values and (
        to_state == JobState.RUNNING or states.is_terminal(to_state) or "attempt" in values
    ):
        values["recovery"] = None
    sets = ", ".join(f"{k} = ${i}" for i, k in enumerate(values, start=2))
    extra = ", finished_at = now()" if states.is_terminal(to_state) else ""
    row = await conn.fetchrow(
        f"UPDATE jobs SET {sets}, updated_at = now(), progress_at = now(){extra} WHERE id = $1"
        f" RETURNING {JOB_COLUMNS}",
        job.id,
        *(_encode(k, v) for k, v in values.items()),
    )
    moved = Job.from_row(row)
    if not states.holds_devices(to_state):
        await release_devices(conn, job.id)
    await _record(conn, moved, job.state, to_state, cause)
    return moved


async def requeue(
    conn: asyncpg.Connection,
    job: Job,
    cause: str,
    *,
    max_attempts: int,
    to_state: JobState = JobState.PENDING,
    resume_from: str | None = None,
    skip_data: tuple[int, int] | None = None,
    preempted: bool = False,
    counted: bool = True,
) -> Job:
    """Start the next attempt: back to the queue (PENDING, or ROLLING_BACK for a restart) with
    attempt + 1, resuming from `resume_from` or the newest valid checkpoint. Past `max_attempts`
    (attempts that ended preempted, or to grow back, do not count; nor this one, when not `counted`) the
    job is FAILED with the cause. A preempted attempt's devices are not offered back to the job: it goes
    elsewhere."""
    used = job.attempt - await uncounted_attempts(conn, job.id) - (0 if counted else 1)
    if used >= max_attempts:
        return await transition(
            conn,
            job,
            JobState.FAILED,
            f"{cause}; no attempts left ({used} of {max_attempts} used)",
            reason=cause,
        )
    resume_from = await usable_checkpoint(conn, job.id, resume_from)
    return await transition(
        conn,
        job,
        to_state,
        cause,
        attempt=job.attempt + 1,
        previous_placement=None if preempted else job.placement or job.previous_placement,
        placement=None,
        resume_from=resume_from,
        skip_data=list(skip_data) if skip_data else None,
    )


async def cancel(conn: asyncpg.Connection, job: Job, reason: str) -> Job:
    """CANCELLED, devices released, and a CancelJob on the job's cmd subject for the workers."""
    return await _end_ranks(conn, job, JobState.CANCELLED, f"cancelled: {reason}", reason, reason)


async def fail(conn: asyncpg.Connection, job: Job, cause: str, reason: str) -> Job:
    """FAILED with its reason, devices released, and a CancelJob so the workers end the ranks."""
    return await _end_ranks(conn, job, JobState.FAILED, cause, reason, f"failed: {reason}")


async def _end_ranks(
    conn: asyncpg.Connection, job: Job, to_state: JobState, cause: str, reason: str, cancel_reason: str
) -> Job:
    moved = await transition(conn, job, to_state, cause, reason=reason)
    await outbox.enqueue(
        conn, subjects.cmd(job.id), CancelJob(job_id=job.id, attempt=job.attempt, reason=cancel_reason)
    )
    return moved


async def raise_incident(conn: asyncpg.Connection, job: Job, incident: IncidentRaised) -> None:
    await outbox.enqueue(conn, subjects.incident(job.id), incident)


async def release_devices(conn: asyncpg.Connection, job_id: str) -> None:
    await conn.execute(
        "UPDATE devices SET job_id = NULL, attempt = NULL, rank = NULL WHERE job_id = $1", job_id
    )


async def uncounted_attempts(conn: asyncpg.Connection, job_id: str) -> int:
    """How many of the job's attempts did not fail: those that ended on a preemption notice (a rank exited
    `preempted`), and those ended to grow the job back to its whole size (`GROW_BACK`)."""
    return await conn.fetchval(
        """SELECT (SELECT count(DISTINCT attempt) FROM job_ranks WHERE job_id = $1 AND failure = 'preempted')
             + (SELECT count(*) FROM job_transitions WHERE job_id = $1 AND left(cause, length($2)) = $2)""",
        job_id,
        GROW_BACK,
    )


async def newest_checkpoint(conn: asyncpg.Connection, job_id: str) -> str | None:
    return await conn.fetchval(
        "SELECT path FROM scheduler_checkpoints WHERE job_id = $1 AND valid ORDER BY step DESC LIMIT 1",
        job_id,
    )


async def usable_checkpoint(conn: asyncpg.Connection, job_id: str, requested: str | None) -> str | None:
    """The checkpoint a relaunch resumes from: `requested`, unless it was refused when loaded
    (`CheckpointRefused`), then the newest valid one before it; with none requested, the newest valid."""
    if requested is None:
        return await newest_checkpoint(conn, job_id)
    refused = await conn.fetchval(
        "SELECT step FROM scheduler_checkpoints WHERE job_id = $1 AND path = $2 AND refused IS NOT NULL",
        job_id,
        requested,
    )
    if refused is None:
        return requested
    return await conn.fetchval(
        """SELECT path FROM scheduler_checkpoints WHERE job_id = $1 AND valid AND step < $2
           ORDER BY step DESC LIMIT 1""",
        job_id,
        refused,
    )


async def refuse_checkpoint(conn: asyncpg.Connection, job_id: str, step: int, reason: str) -> bool:
    """Mark the job's checkpoint of `step` bad: never resumed from again; True when it was not before."""
    status = await conn.execute(
        """UPDATE scheduler_checkpoints SET valid = false, refused = $3
           WHERE job_id = $1 AND step = $2 AND refused IS NULL""",
        job_id,
        step,
        reason,
    )
    return status != "UPDATE 0"


async def _record(
    conn: asyncpg.Connection, job: Job, from_state: JobState | None, to_state: JobState, cause: str
) -> None:
    event = JobStateChanged(
        job_id=job.id, attempt=job.attempt, from_state=from_state, to_state=to_state, cause=cause
    )
    await conn.execute(
        """INSERT INTO job_transitions (job_id, attempt, from_state, to_state, cause, event_id)
           VALUES ($1, $2, $3, $4, $5, $6)""",
        job.id,
        job.attempt,
        from_state,
        to_state,
        cause,
        event.event_id,
    )
    await outbox.enqueue(conn, subjects.status(job.id, subjects.CONTROL), event)


async def note_progress(conn: asyncpg.Connection, job_id: str, recovery: dict[str, Any] | None = None) -> Job:
    """The job moved without changing state (a rank started, exited, halted); with `recovery`, the
    recovery under way is now that."""
    if recovery is None:
        row = await conn.fetchrow(
            f"UPDATE jobs SET progress_at = now() WHERE id = $1 RETURNING {JOB_COLUMNS}", job_id
        )
    else:
        row = await conn.fetchrow(
            f"UPDATE jobs SET progress_at = now(), recovery = $2 WHERE id = $1 RETURNING {JOB_COLUMNS}",
            job_id,
            json.dumps(recovery),
        )
    return Job.from_row(row)


def _encode(key: str, value: Any) -> Any:
    if key in ("placement", "previous_placement", "trace_context", "spec", "recovery") and value is not None:
        return json.dumps(value)
    return value
