"""The queue over HTTP: `GET /api/v1/queue`, every queued job the caller may see with its position in the
whole queue, why it waits and its estimated start (`schedule_inputs.read_queue`), and the teams' fair-share
standings. `queue_entry` gives a queued job's detail the same."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

import asyncpg
from litestar import Controller, Request, get
from litestar.di import NamedDependency

from vigil.api import QueueEntryOut, QueueOut, TeamStandingOut
from vigil.jobstates import TERMINAL_STATES
from vigil_common.settings import Settings
from vigil_scheduler.core import Scheduler
from vigil_scheduler.gateway.auth import principal
from vigil_scheduler.gateway.schemas import error_responses
from vigil_scheduler.principals import Principal
from vigil_scheduler.schedule_inputs import QueueView, read_queue

SchedulerDep = NamedDependency[Scheduler]


class QueueController(Controller):
    path = "/queue"
    tags = ["jobs"]

    @get(
        "/",
        summary="Queued jobs in queue order: position, why each waits, estimated start; teams' fair share",
        responses=error_responses(401),
    )
    async def queue(self, request: Request, scheduler: SchedulerDep) -> QueueOut:
        return await queue_of(scheduler.pool, scheduler.settings, principal(request))


async def queue_of(pool: asyncpg.Pool, settings: Settings, viewer: Principal) -> QueueOut:
    """The queue as `viewer` may see it (their own and their team's jobs; an admin every job)."""
    return queue_out(await read_queue(pool, settings, lambda job: viewer.sees(job.owner, job.team)))


async def queue_entry(
    pool: asyncpg.Pool, settings: Settings, viewer: Principal, job_id: str
) -> QueueEntryOut | None:
    """A queued job's place in the queue; None for a job not queued."""
    found = await queue_of(pool, settings, viewer)
    return next((e for e in found.items if e.id == job_id), None)


def may_wait(detail: dict[str, Any]) -> bool:
    """Whether a job's detail (`queries.job_detail`) may be of a queued job: no placement, not ended."""
    return not detail["placement"] and detail["state"] not in TERMINAL_STATES


def queue_out(view: QueueView) -> QueueOut:
    items = []
    for entry in view.entries:
        job = view.jobs[entry.job_id]
        start = entry.estimated_start
        items.append(
            QueueEntryOut(
                id=job.id,
                name=job.name,
                owner=job.owner,
                team=job.team,
                priority=job.priority,
                gpus=job.world_size,
                position=entry.position,
                reason=entry.reason,
                estimated_start=None if start is None else datetime.fromtimestamp(start, UTC),
                reserved=entry.reserved,
                starting=entry.starting,
                created_at=job.created_at,
            )
        )
    teams = [
        TeamStandingOut(
            team=s.team, share=s.share, usage=s.usage, gpu_hours=s.gpu_hours, ratio=s.ratio, factor=s.factor
        )
        for s in sorted(view.standing.values(), key=lambda s: (s.team is None, s.team or ""))
    ]
    return QueueOut(items=items, teams=teams, as_of=datetime.fromtimestamp(view.now, UTC))
