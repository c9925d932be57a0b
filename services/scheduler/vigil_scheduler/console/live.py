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
from collections.abc import AsyncIterator

import asyncpg
from litestar.response import ServerSentEventMessage

from vigil_common import readmodel, subjects
from vigil_common.bus import Bus
from vigil_common.events import IncidentRaised, JobStateChanged, RanksHalted, RollbackCompleted
from vigil_common.waiting import wait_any
from vigil_scheduler.queries import Visible

KEEPALIVE_S = 15.0
SHOWN = (JobStateChanged, IncidentRaised, RanksHalted, RollbackCompleted)  # passed on as they come


async def console_events(
    bus: Bus, closing: asyncio.Event, visible: Visible
) -> AsyncIterator[ServerSentEventMessage]:
    """The events of the jobs the reader may see (`visible`), as they come."""
    async with bus.watch(subjects.ALL_STATUS, subjects.ALL_INCIDENTS) as events:
        stream = aiter(events)
        pending = asyncio.ensure_future(anext(stream))
        stopping = asyncio.ensure_future(closing.wait())
        try:
            yield ServerSentEventMessage(comment="connected")
            while True:
                done, _ = await asyncio.wait(
                    {pending, stopping}, timeout=KEEPALIVE_S, return_when="FIRST_COMPLETED"
                )
                if stopping in done:
                    return
                if pending in done:
                    event = pending.result()
                    pending = asyncio.ensure_future(anext(stream))
                    if isinstance(event, SHOWN) and await visible.job(event.job_id):
                        yield ServerSentEventMessage(
                            data=event.model_dump_json(), event=event.type, id=event.event_id
                        )
                else:
                    yield ServerSentEventMessage(comment="keep-alive")
        finally:
            pending.cancel()
            stopping.cancel()


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
