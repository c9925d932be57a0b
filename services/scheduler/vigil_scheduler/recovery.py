"""A halt or rollback its ranks outran, and a transition that stalled: what the scheduler knows about a
job's recovery (`Job.recovery`, `Job.recovery_incidents`), what was missing, and the incidents it raises.

The decisions are `states.settlement` (pure); this module gathers their inputs and words their causes.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any

import asyncpg

from vigil.events import HaltJob, IncidentAction, IncidentRaised, RollbackJob
from vigil.jobstates import JobState
from vigil_scheduler import lifecycle
from vigil_scheduler.lifecycle import Job


@dataclass(frozen=True)
class Exits:
    """How the current attempt's ranks ended, as far as their reports reached us."""

    world_size: int
    ok: frozenset[int]  # exited 0
    started: frozenset[int]
    exited: frozenset[int]

    @property
    def finished(self) -> bool:
        return len(self.ok) >= self.world_size

    def missing(self, of: frozenset[int]) -> list[int]:
        return [r for r in range(self.world_size) if r not in of]

    def never_exited(self) -> str:
        """e.g. "rank 1's exit never reported"."""
        return _ranks(self.missing(self.exited), "exit")

    def never_started(self) -> str:
        return _ranks(self.missing(self.started), "start")


async def exits(conn: asyncpg.Connection, job: Job) -> Exits:
    rows = await conn.fetch(
        "SELECT rank, exit_code, started_at, exited_at FROM job_ranks WHERE job_id = $1 AND attempt = $2",
        job.id,
        job.attempt,
    )
    return Exits(
        job.attempt_world_size,
        frozenset(r["rank"] for r in rows if r["exited_at"] is not None and r["exit_code"] == 0),
        frozenset(r["rank"] for r in rows if r["started_at"] is not None),
        frozenset(r["rank"] for r in rows if r["exited_at"] is not None),
    )


def halt_record(command: HaltJob) -> dict[str, Any]:
    return {"command_id": command.event_id, "incident_id": command.incident_id, "reason": command.reason}


def rollback_record(command: RollbackJob) -> dict[str, Any]:
    return {
        "command_id": command.event_id,
        "incident_id": command.incident_id,
        "reason": command.reason,
        "checkpoint": command.checkpoint,
        "step": command.step,
        "skip_data": list(command.skip_data) if command.skip_data else None,
    }


def under(job: Job, **change: Any) -> dict[str, Any]:
    """The job's recovery with `change` (a new halt, rollback or halted step) in it."""
    return {**(job.recovery or {}), **change}


def unapplied(job: Job) -> bool | None:
    """Whether the bad step behind the job's rollback (or halt) never had its update applied: None while
    its incident has not reached us; False for a command no incident caused (an operator's)."""
    rec = job.recovery or {}
    command = rec.get("rollback") or rec.get("halt") or {}
    iid = command.get("incident_id")
    if iid is None:
        return False
    return job.recovery_incidents.get(iid)


def incident_unapplied(event: IncidentRaised) -> bool:
    """The incident's bad step was never applied: held, or its update skipped as non-finite."""
    evidence = event.evidence
    return bool(evidence.get("skipped") is True or evidence.get("unapplied") is True or "held_s" in evidence)


async def note_incident(conn: asyncpg.Connection, job_id: str, incident_id: str, unapplied: bool) -> None:
    await conn.execute(
        "UPDATE jobs SET recovery_incidents = recovery_incidents || jsonb_build_object($2::text, $3::bool)"
        " WHERE id = $1",
        job_id,
        incident_id,
        unapplied,
    )


def what_stalled(job: Job, found: Exits, timeout_s: float) -> str:
    """What a halt or rollback that made no progress for `timeout_s` was waiting for."""
    rec = job.recovery or {}
    waited = f"no progress for {timeout_s:g}s"
    if found.ok:
        return f"{found.never_exited()} ({waited})"
    if rollback := rec.get("rollback"):
        return f"the rollback to step {rollback['step']} never completed: no RollbackCompleted ({waited})"
    if job.state == JobState.ROLLING_BACK:
        return f"the rollback never completed: no RollbackCompleted ({waited})"
    if "halted_step" not in rec:
        return f"the ranks never reported halting: no RanksHalted ({waited})"
    return f"the halt was never resolved ({waited})"


def rollback_target(job: Job) -> tuple[int, str, tuple[int, int] | None] | None:
    """(step, checkpoint, skip_data) of the job's rollback under way, if any."""
    rollback = (job.recovery or {}).get("rollback")
    if not rollback:
        return None
    skip = rollback.get("skip_data")
    return rollback["step"], rollback["checkpoint"], (skip[0], skip[1]) if skip else None


async def raise_about(
    conn: asyncpg.Connection, job: Job, message: str, *, action: IncidentAction = "alert", **evidence: Any
) -> None:
    """A `lifecycle` incident about the job (one per job, attempt and message under redelivery)."""
    key = repr((job.id, job.attempt, message)).encode()
    await lifecycle.raise_incident(
        conn,
        job,
        IncidentRaised(
            event_id="inc-" + hashlib.sha256(key).hexdigest()[:28],
            job_id=job.id,
            attempt=job.attempt,
            kind="lifecycle",
            action=action,
            message=message[:2000],
            evidence=evidence,
        ),
    )


def _ranks(ranks: list[int], what: str) -> str:
    if not ranks:
        return f"every rank's {what} reported"
    if len(ranks) == 1:
        return f"rank {ranks[0]}'s {what} never reported"
    return f"ranks {', '.join(map(str, ranks))}: {what}s never reported"
