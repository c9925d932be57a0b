"""Server-sent events for the console, on the bus's watch mechanism like the API's /api/v1/events:
job state changes, incidents, halts and rollbacks as they happen, and a job's training progress
coalesced to at most one `progress` event per `every_s` (a page refetches its downsampled curves on
it, so a browser makes one request a second while a job trains, never one per rank-step)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator

from litestar.response import ServerSentEventMessage

from vigil_common import subjects
from vigil_common.bus import Bus
from vigil_common.events import IncidentRaised, JobStateChanged, RanksHalted, RollbackCompleted, StepCompleted

KEEPALIVE_S = 15.0
SHOWN = (JobStateChanged, IncidentRaised, RanksHalted, RollbackCompleted)  # passed on as they come


async def console_events(
    bus: Bus, closing: asyncio.Event, job: str | None, *, every_s: float = 1.0
) -> AsyncIterator[ServerSentEventMessage]:
    watched = [subjects.ALL_STATUS, subjects.ALL_INCIDENTS]
    if job is not None:
        watched.append(subjects.job_steps(job))
    loop = asyncio.get_running_loop()
    async with bus.watch(*watched) as events:
        stream = aiter(events)
        pending = asyncio.ensure_future(anext(stream))
        stopping = asyncio.ensure_future(closing.wait())
        progress: int | None = None  # the newest step not yet announced
        sent_at = 0.0
        try:
            yield ServerSentEventMessage(comment="connected")
            while True:
                due = sent_at + every_s - loop.time()
                timeout = max(due, 0.0) if progress is not None else KEEPALIVE_S
                done, _ = await asyncio.wait(
                    {pending, stopping}, timeout=timeout, return_when="FIRST_COMPLETED"
                )
                if stopping in done:
                    return
                if pending in done:
                    event = pending.result()
                    pending = asyncio.ensure_future(anext(stream))
                    if isinstance(event, StepCompleted) and event.job_id == job:
                        progress = max(progress if progress is not None else -1, event.step)
                    elif isinstance(event, SHOWN) and job in (None, event.job_id):
                        yield ServerSentEventMessage(
                            data=event.model_dump_json(), event=event.type, id=event.event_id
                        )
                if progress is not None and loop.time() >= sent_at + every_s:
                    yield ServerSentEventMessage(data=json.dumps({"step": progress}), event="progress")
                    progress, sent_at = None, loop.time()
                elif not done:
                    yield ServerSentEventMessage(comment="keep-alive")
        finally:
            pending.cancel()
            stopping.cancel()
