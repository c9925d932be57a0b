"""Server-sent events for the console.

A job's page has one live source: `job_changes` says `changed` (its data: the new version) whenever
what the page shows has changed in the database (`readmodel.job_version`: the job's row, its stored
steps, status events and incidents), checked once per `every_s`, and the page then refetches its one
document (`/console/data/jobs/{id}`: header, curves, marks, attempts, checkpoints, incidents). Asking the
database, not the bus, means the page never refetches before telemetry has stored what the bus
carried, so nothing on it lags behind the rest.

The other pages (jobs, cluster, incidents) take `console_events`: job state changes, incidents, halts
and rollbacks as they come on the bus, on the same watch mechanism as the API's /api/v1/events.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence

import asyncpg
from litestar.response import ServerSentEventMessage

from vigil.events import IncidentRaised, JobStateChanged, Message, RanksHalted, RollbackCompleted
from vigil_common import readmodel, subjects
from vigil_common.bus import Bus
from vigil_common.waiting import wait_any
from vigil_scheduler.gateway import sse
from vigil_scheduler.queries import Visible

KEEPALIVE_S = 15.0  # job_changes's, and console_events's unless told (VIGIL_SSE_KEEPALIVE_S)
WATCHED = (subjects.ALL_STATUS, subjects.ALL_INCIDENTS)
SHOWN = (JobStateChanged, IncidentRaised, RanksHalted, RollbackCompleted)  # passed on as they come


def console_events(
    bus: Bus,
    closing: asyncio.Event,
    visible: Visible,
    *,
    resume_at: Sequence[int] | None = None,
    keepalive_s: float = KEEPALIVE_S,
) -> AsyncIterator[ServerSentEventMessage]:
    """The events of the jobs the reader may see (`visible`), as they come; a browser that reconnects
    resumes after the last it had (`gateway.sse`)."""

    async def shown(event: Message) -> bool:
        return isinstance(event, SHOWN) and await visible.job(event.job_id)

    return sse.watched_events(bus, closing, WATCHED, shown, resume_at=resume_at, keepalive_s=keepalive_s)


async def job_changes(
    pool: asyncpg.Pool, closing: asyncio.Event, job_id: str, *, every_s: float = 1.0
) -> AsyncIterator[ServerSentEventMessage]:
    """`changed` (data: the job's version) at once, then whenever the version moves; a keep-alive comment
    when nothing did for KEEPALIVE_S. Ends when the gateway closes."""
    loop = asyncio.get_running_loop()
    sent: str | None = None
    quiet_since = loop.time()
    yield ServerSentEventMessage(comment="connected")
    while True:
        version = await readmodel.job_version(pool, job_id)
        if version is not None and version != sent:
            yield ServerSentEventMessage(data=version, event="changed")
            sent, quiet_since = version, loop.time()
        elif loop.time() - quiet_since >= KEEPALIVE_S:
            yield ServerSentEventMessage(comment="keep-alive")
            quiet_since = loop.time()
        if await wait_any(closing, timeout_s=every_s):
            return
