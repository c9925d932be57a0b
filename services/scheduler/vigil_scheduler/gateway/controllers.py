"""Thin controllers: each parses the request, calls the scheduler or a query, and shapes the answer."""

from __future__ import annotations

import asyncio
import dataclasses
from typing import Annotated

import asyncpg
from litestar import Controller, Request, Response, get, post
from litestar.di import NamedDependency
from litestar.openapi.datastructures import ResponseSpec
from litestar.params import FromQuery, HeaderParameter, QueryParameter, RawBody
from litestar.response import ServerSentEvent
from litestar.status_codes import HTTP_200_OK, HTTP_201_CREATED, HTTP_503_SERVICE_UNAVAILABLE

from vigil.api import (
    ControlPlaneOut,
    DeviceMarkCleared,
    GpuPage,
    Health,
    HolderOut,
    JobDetailOut,
    JobOut,
    JobPage,
    NodePage,
    Page,
)
from vigil.events import IncidentRaised, JobStateChanged, Message
from vigil.jobstates import JobState
from vigil.spec import parse_spec
from vigil_common import lease, readmodel, subjects
from vigil_common.bus import Bus
from vigil_scheduler import audit, idempotency, queries
from vigil_scheduler.core import Scheduler
from vigil_scheduler.gateway import sse
from vigil_scheduler.gateway.auth import actor, admin_guard, principal
from vigil_scheduler.gateway.params import (
    Attempt,
    Cursor,
    DeviceIndex,
    JobEvents,
    JobId,
    JobIdFilter,
    Limit,
    NodeName,
    Rank,
)
from vigil_scheduler.gateway.parsing import off_loop
from vigil_scheduler.gateway.queue import may_wait, queue_entry
from vigil_scheduler.gateway.schemas import SubmitOperation, error_responses

Pool = NamedDependency[asyncpg.Pool]
BusDep = NamedDependency[Bus]
SchedulerDep = NamedDependency[Scheduler]
StateFilter = Annotated[JobState | None, QueryParameter(name="state", description="only jobs in this state")]
READ = error_responses(401, 422)
ONE_JOB = error_responses(401, 404, 422)
WATCHED = (subjects.ALL_STATUS, subjects.ALL_INCIDENTS)  # what /events sends (its ids' order)
LastEventId = Annotated[
    str | None,
    HeaderParameter(
        name=sse.LAST_EVENT_ID,
        description="resume after the event with this id (what a client that lost the stream sends)",
    ),
]


class JobController(Controller):
    path = "/jobs"
    tags = ["jobs"]

    @post(
        "/",
        status_code=HTTP_201_CREATED,
        summary="Submit a job spec (JSON or YAML body)",
        operation_class=SubmitOperation,
        responses={
            200: ResponseSpec(
                data_container=JobOut,
                description="the job an earlier submit with this Idempotency-Key and body made",
                generate_examples=False,
            ),
            **error_responses(401, 409, 413, 422),
        },
        description=(
            "With an `Idempotency-Key` header (1-255 printable ASCII characters, kept a day per token), a "
            "submit sent again with the same key and body returns the job made the first time (200); the "
            "same key with another body is a 409."
        ),
    )
    async def submit(self, request: Request, body: RawBody, scheduler: SchedulerDep) -> Response[JobOut]:
        key = idempotency.checked(request.headers.get(idempotency.HEADER))
        content_type = request.headers.get("content-type")
        spec = await off_loop(request, parse_spec, body, content_type=content_type)
        once = None if key is None else (key, idempotency.body_digest(body, content_type))
        job, made = await scheduler.submit(
            spec, principal(request), parent=dict(request.headers), idempotency=once
        )
        out = JobOut.model_validate(queries.job_view(job))
        return Response(out, status_code=HTTP_201_CREATED if made else HTTP_200_OK)

    @get(
        "/",
        summary="Jobs the caller may see (its own, its team's; an admin: all), newest first",
        responses=READ,
    )
    async def list_jobs(
        self,
        request: Request,
        pool: Pool,
        state_filter: StateFilter = None,
        limit: Limit = 100,
        cursor: Cursor = None,
    ) -> JobPage:
        page = await queries.list_jobs(
            pool, principal(request), state=state_filter, limit=limit, cursor=cursor
        )
        return JobPage.model_validate(page)

    @get(
        "/{job_id:str}",
        summary="One job: state, placement, attempts, last step, latest loss",
        responses=ONE_JOB,
    )
    async def get_job(
        self, request: Request, pool: Pool, scheduler: SchedulerDep, job_id: JobId
    ) -> JobDetailOut:
        detail = await queries.job_detail(pool, job_id, principal(request))
        if may_wait(detail):  # its place in the queue
            detail["queue"] = await queue_entry(pool, scheduler.settings, principal(request), job_id)
        return JobDetailOut.model_validate(detail)

    @post(
        "/{job_id:str}/cancel",
        status_code=HTTP_200_OK,
        summary="Cancel a queued or running job",
        responses=error_responses(401, 404, 409, 422),
    )
    async def cancel(self, request: Request, scheduler: SchedulerDep, job_id: JobId) -> JobOut:
        job = await scheduler.cancel(job_id, principal(request))
        return JobOut.model_validate(queries.job_view(job))

    @get("/{job_id:str}/steps", summary="Step metrics, per rank or aggregated per step", responses=ONE_JOB)
    async def steps(
        self,
        request: Request,
        pool: Pool,
        job_id: JobId,
        rank: Rank = None,
        attempt: Attempt = None,
        aggregate: FromQuery[bool] = False,
        limit: Limit = 100,
        cursor: Cursor = None,
    ) -> Page:
        await queries.require_job(pool, job_id, principal(request))
        return Page.model_validate(
            await readmodel.steps(
                pool, job_id, rank=rank, attempt=attempt, aggregate=aggregate, limit=limit, cursor=cursor
            )
        )

    @get("/{job_id:str}/checkpoints", summary="Checkpoints with step, validity, size", responses=ONE_JOB)
    async def checkpoints(
        self, request: Request, pool: Pool, job_id: JobId, limit: Limit = 100, cursor: Cursor = None
    ) -> Page:
        await queries.require_job(pool, job_id, principal(request))
        return Page.model_validate(await readmodel.checkpoints(pool, job_id, limit=limit, cursor=cursor))

    @get("/{job_id:str}/incidents", summary="What the guardian saw and did for this job", responses=ONE_JOB)
    async def job_incidents(
        self, request: Request, pool: Pool, job_id: JobId, limit: Limit = 100, cursor: Cursor = None
    ) -> Page:
        await queries.require_job(pool, job_id, principal(request))
        return Page.model_validate(await readmodel.incidents(pool, job_id=job_id, limit=limit, cursor=cursor))


class ControlPlaneController(Controller):
    tags = ["control plane"]

    @get("/control-plane", summary="The active scheduler and guardian", responses=READ)
    async def control_plane(self, pool: Pool) -> ControlPlaneOut:
        found = await lease.holders(pool)
        return ControlPlaneOut(active=[HolderOut(**dataclasses.asdict(h)) for h in found])


class InventoryController(Controller):
    tags = ["inventory"]

    @get("/nodes", summary="Nodes with their devices and liveness", responses=READ)
    async def nodes(
        self, request: Request, pool: Pool, scheduler: SchedulerDep, limit: Limit = 100, cursor: Cursor = None
    ) -> NodePage:
        spares = scheduler.settings.hot_spares
        page = await queries.list_nodes(pool, principal(request), limit=limit, cursor=cursor, spares=spares)
        return NodePage.model_validate(page)

    @get("/gpus", summary="Devices with health, owner job and latest sample", responses=READ)
    async def gpus(self, request: Request, pool: Pool, limit: Limit = 100, cursor: Cursor = None) -> GpuPage:
        page = await queries.list_gpus(pool, principal(request), limit=limit, cursor=cursor)
        return GpuPage.model_validate(page)

    @post(
        "/gpus/{node:str}/{index:int}/clear",
        status_code=HTTP_200_OK,
        summary="Clear a device's unhealthy mark (admin; audited): placement offers it again",
        guards=[admin_guard],
        responses=error_responses(401, 403, 404, 422),
    )
    async def clear_mark(
        self, request: Request, scheduler: SchedulerDep, node: NodeName, index: DeviceIndex
    ) -> DeviceMarkCleared:
        return DeviceMarkCleared.model_validate(
            await scheduler.clear_device_mark(node, index, actor(request))
        )

    @get(
        "/incidents",
        summary="Incidents of every job the caller may see (an admin: all), newest first",
        tags=["incidents"],
        responses=READ,
    )
    async def incidents(
        self, request: Request, pool: Pool, limit: Limit = 100, cursor: Cursor = None
    ) -> Page:
        return Page.model_validate(
            await readmodel.incidents(
                pool, limit=limit, cursor=cursor, visible_to=queries.visibility(principal(request))
            )
        )


class EventsController(Controller):
    tags = ["events"]

    @get(
        "/events",
        summary="Server-sent events: job state changes and incidents, live; resumable with Last-Event-ID",
        media_type="text/event-stream",
        responses=READ,
    )
    async def events(
        self,
        request: Request,
        bus: BusDep,
        pool: Pool,
        job: JobEvents = None,  # an empty or malformed id is a 422 naming `job`, not a 404
        last_event_id: LastEventId = None,
    ) -> ServerSentEvent:
        resume_at = sse.parse_last_event_id(last_event_id, len(WATCHED))
        viewer = principal(request)
        if job is not None:
            await queries.require_job(pool, job, viewer)  # a 404, as for a job that does not exist
        visible = queries.Visible(pool, viewer)

        async def shown(event: Message) -> bool:
            return (
                isinstance(event, JobStateChanged | IncidentRaised)
                and job in (None, event.job_id)
                and await visible.job(event.job_id)
            )

        state = request.app.state
        return ServerSentEvent(
            sse.watched_events(
                bus, state.closing, WATCHED, shown, resume_at=resume_at, keepalive_s=state.sse_keepalive_s
            )
        )


class AuditController(Controller):
    path = "/audit"
    tags = ["audit"]

    @get(
        "/",
        summary="Who asked for each submit, cancel, halt, rollback, restart and resume; newest first",
        responses=READ,
    )
    async def list_audit(
        self,
        request: Request,
        pool: Pool,
        job_id: JobIdFilter = None,
        limit: Limit = 100,
        cursor: Cursor = None,
    ) -> Page:
        """An admin reads every record; a user those of the jobs it may see."""
        visible_to = queries.visibility(principal(request))
        return Page.model_validate(
            await audit.list_records(pool, job_id=job_id, limit=limit, cursor=cursor, visible_to=visible_to)
        )


class HealthController(Controller):
    tags = ["health"]

    @get("/healthz", summary="The process is up")
    async def healthz(self) -> Health:
        return Health(status="ok")

    @get("/readyz", summary="Postgres and NATS answer (503 when not)")
    async def readyz(self, pool: Pool, bus: BusDep, scheduler: SchedulerDep) -> Response[Health]:
        checks = {"postgres": "ok", "nats": "ok" if bus.nc.is_connected else "disconnected"}
        try:
            await asyncio.wait_for(pool.fetchval("SELECT 1"), timeout=2)
        except (OSError, TimeoutError, asyncpg.PostgresError) as exc:
            checks["postgres"] = f"error: {exc}"
        ready = all(v == "ok" for v in checks.values())
        return Response(
            Health(
                status="ready" if ready else "not ready",
                checks=checks,
                role="active" if scheduler.active else "standby",
            ),
            status_code=HTTP_200_OK if ready else HTTP_503_SERVICE_UNAVAILABLE,
        )
