"""Stopping a running attempt on the spot path (`PreemptJob`), and the placement pass's preemption.

`stop` sends one attempt its `PreemptJob` (kind `preempt` or `time_limit`), once: a `job_stops` row per
attempt (migration 0021) is the one stop in flight, so a pass or a sweep that runs again before the ranks
exit sends nothing twice. With it go an audit row, an incident (kind `preemption` or `time_limit`) and the
job's progress. The workers holding the attempt's ranks notify them; the ranks finish the step, write the
emergency checkpoint within VIGIL_PREEMPTION_GRACE_S and exit `preempted`; the scheduler's handlers then
requeue a preempted job (cause: this stop's reason) or end one past its limit (`stopped`).

`preempt_for` is the placement pass's: after `plan`, the job of highest priority left unplaced (not held
back by a quota) preempts the victims `preemption.choose` names. The devices of victims already being
stopped count as free for it (their ranks are on their way out; after they exit, until their worker's
heartbeat reports the devices free, those of its own victims do too), so a pass that runs again chooses
nobody more; and it is the highest-priority job, so the pass after their exit places it first.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, replace
from typing import Any

import asyncpg

from vigil.events import IncidentRaised, PreemptJob, StopKind
from vigil.jobstates import JobState
from vigil_common import subjects
from vigil_common.settings import Settings
from vigil_scheduler import audit, lifecycle, outbox
from vigil_scheduler.lifecycle import Job
from vigil_scheduler.placement import Inventory, Placement, PlacementRequest, fits_ever, place, queue_order
from vigil_scheduler.preemption import Running, choose, freed, preemptible
from vigil_scheduler.states import JobEvent, Outcome, outcome

log = logging.getLogger(__name__)

ACTOR = "service:scheduler"  # who the audit names for the scheduler's own stops
# After its ranks exit, the devices of a preemptor's victims count as free for it this long at most, until
# their worker's heartbeat reports them free (beyond the grace period: a victim's node may be gone).
FREED_FOR_S = 30.0


@dataclass(frozen=True)
class Stop:
    """The stop in flight for an attempt (a `job_stops` row)."""

    kind: StopKind
    reason: str
    by_job: str | None


async def stop(
    conn: asyncpg.Connection,
    job: Job,
    kind: StopKind,
    reason: str,
    *,
    by_job: str | None = None,
    devices: Iterable[tuple[str, int]] = (),
    **evidence: Any,
) -> bool:
    """Stop `job`'s current attempt on the spot path (see the module docstring), in the caller's
    transaction, `job` locked. False when a stop of this attempt is in flight already (nothing sent)."""
    held = sorted(devices)
    stored = await conn.fetchval(
        """INSERT INTO job_stops (job_id, attempt, kind, by_job, reason, devices)
           VALUES ($1, $2, $3, $4, $5, $6::jsonb) ON CONFLICT (job_id, attempt) DO NOTHING RETURNING true""",
        job.id,
        job.attempt,
        kind,
        by_job,
        reason,
        json.dumps(held),
    )
    if not stored:
        return False
    command = PreemptJob(
        event_id=f"stop-{job.id}-{job.attempt}",
        job_id=job.id,
        attempt=job.attempt,
        kind=kind,
        reason=reason[:2000],
        by_job=by_job,
    )
    await outbox.enqueue(conn, subjects.cmd(job.id), command)
    detail = {"reason": reason, "by_job": by_job, "devices": len(held), **evidence}
    await audit.record(conn, kind, ACTOR, job.id, job.attempt, event_id=command.event_id, detail=detail)
    incident = IncidentRaised(
        event_id=f"inc-{command.event_id}",
        job_id=job.id,
        attempt=job.attempt,
        kind="preemption" if kind == "preempt" else "time_limit",
        action="alert",
        message=reason[:2000],
        evidence={"by_job": by_job, "devices": len(held), **evidence},
    )
    await lifecycle.raise_incident(conn, job, incident)
    await lifecycle.note_progress(conn, job.id)
    log.warning("%s attempt %d: stopping on the spot path: %s", job.id, job.attempt, reason)
    return True


async def stop_of(conn: asyncpg.Connection, job: Job) -> Stop | None:
    """The stop in flight for the job's current attempt, if any."""
    row = await conn.fetchrow(
        "SELECT kind, reason, by_job FROM job_stops WHERE job_id = $1 AND attempt = $2", job.id, job.attempt
    )
    return Stop(row["kind"], row["reason"], row["by_job"]) if row else None


async def preempt_for(
    conn: asyncpg.Connection,
    settings: Settings,
    queue: Iterable[PlacementRequest],
    placed: Iterable[Placement],
    snapshot: Inventory,
    held_back: Mapping[str, str] | None = None,
    over_share: Callable[[str | None], bool] | None = None,
) -> list[str]:
    """The placement pass's preemption, after `plan` placed `placed` (and launched them, in this
    transaction, which holds the placement lock): the first queued job in the queue's order that is left
    unplaced, not `held_back` by a quota and fits the healthy cluster stops the victims `preemption.choose`
    names. `snapshot`: the inventory with this pass's placements (`plan` returns it; their devices are
    claimed in this transaction). `over_share(team)`: a team holding more than its fair share (its jobs are
    taken first); None: none is. The victims' ids."""
    done = {p.job_id for p in placed}
    waiting = held_back or {}
    # in the queue's own order (priority, fair share, submission); a job the healthy cluster can never
    # hold frees nothing by preempting, and does not keep the next one from it
    left = (r for r in sorted(queue, key=queue_order) if r.job_id not in done and r.job_id not in waiting)
    blocked = next((r for r in left if fits_ever(r, snapshot)), None)
    if blocked is None:
        return []
    rows = await conn.fetch(
        """SELECT j.id, j.priority, j.team, j.state, j.spec->'scheduling'->'preemptible' AS preemptible,
                  s.job_id IS NOT NULL AS stopping,
                  (SELECT extract(epoch FROM max(t.occurred_at)) FROM job_transitions t
                    WHERE t.job_id = j.id AND t.attempt = j.attempt AND t.to_state = 'RUNNING') AS started
           FROM jobs j LEFT JOIN job_stops s ON s.job_id = j.id AND s.attempt = j.attempt
           WHERE j.id IN (SELECT DISTINCT job_id FROM devices WHERE job_id IS NOT NULL)"""
    )
    stopping = {r["id"] for r in rows if r["stopping"]}
    within = settings.preemption_grace_s + FREED_FOR_S
    room = _on_their_way(freed(snapshot, stopping), await _freed_for(conn, blocked.job_id, within))
    if place(blocked, room) is not None:
        return []  # what is being stopped already makes room: wait for it
    below = settings.preemptible_below_priority
    running = [
        Running(
            job_id=r["id"],
            priority=r["priority"],
            preemptible=preemptible(_flag(r["preemptible"]), r["priority"], below),
            started=float(r["started"] or 0.0),
            team=r["team"],
        )
        for r in rows
        if r["state"] == JobState.RUNNING and not r["stopping"]
    ]
    victims = choose(blocked, room, running, over_share or (lambda team: False))
    if victims is None:
        return []
    stopped = []
    for victim in victims.jobs:
        job = await lifecycle.lock_job(conn, victim.job_id)
        if job is None or outcome(job.state, job.queued, JobEvent.PREEMPT) != Outcome.STOP:
            continue  # it moved since the snapshot: no longer running
        devices = snapshot.assigned(job.id)
        reason = (
            f"preempted by {blocked.job_id} (priority {blocked.priority} > {job.priority}): needs "
            f"{_amount(blocked.world_size, snapshot)}"
        )
        if await stop(
            conn,
            job,
            "preempt",
            reason,
            by_job=blocked.job_id,
            devices=devices,
            preemptor_priority=blocked.priority,
            priority=job.priority,
            needs=blocked.world_size,
        ):
            stopped.append(job.id)
    return stopped


async def _freed_for(conn: asyncpg.Connection, job_id: str, within_s: float) -> set[tuple[str, int]]:
    """The devices of `job_id`'s victims stopped in the last `within_s` that are given to no job now (their
    ranks exited): free for it, though their worker may not have said so yet."""
    rows = await conn.fetch(
        """SELECT DISTINCT d.node, d.index FROM job_stops s
           CROSS JOIN LATERAL jsonb_array_elements(s.devices) AS held(pair)
           JOIN devices d ON d.node = held.pair->>0 AND d.index = (held.pair->>1)::int
           WHERE s.by_job = $1 AND s.requested_at > now() - make_interval(secs => $2) AND d.job_id IS NULL""",
        job_id,
        within_s,
    )
    return {(r["node"], r["index"]) for r in rows}


def _on_their_way(snapshot: Inventory, devices: set[tuple[str, int]]) -> Inventory:
    """`snapshot` with `devices` (given to no job) counted as reported free."""
    if not devices:
        return snapshot
    nodes = tuple(
        replace(
            n,
            devices=tuple(
                replace(d, reported_free=True) if (n.name, d.index) in devices and d.job_id is None else d
                for d in n.devices
            ),
        )
        for n in snapshot.nodes
    )
    return Inventory(nodes)


def _flag(value: Any) -> bool | None:
    """The spec's `scheduling.preemptible` as stored (jsonb: true, false, or absent)."""
    if isinstance(value, str):
        value = json.loads(value)
    return value if isinstance(value, bool) else None


def _amount(count: int, snapshot: Inventory) -> str:
    """`count` devices as a person says it: "4 GPUs", "1 CPU slot"."""
    gpus = any(d.kind == "gpu" for n in snapshot.nodes for d in n.devices)
    what = "GPU" if gpus else "CPU slot"
    return f"{count} {what}{'' if count == 1 else 's'}"
