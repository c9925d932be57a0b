"""The console's pages and their data: thin handlers that read through `vigil_scheduler.queries` and
`vigil_common.readmodel`, shape with `views`, and render a template. A job's page is a frame whose
content comes from one document (`jobpage`), refetched when `live.job_changes` says it changed."""

from __future__ import annotations

import asyncio
from typing import Annotated, Any

import anyio
import asyncpg
from litestar import Controller, Request, Response, get, post
from litestar.di import NamedDependency
from litestar.params import FromQuery, HeaderParameter, QueryParameter
from litestar.response import Redirect, ServerSentEvent, Template

from vigil.errors import Conflict, NotFound, SpecError
from vigil.jobstates import JobState
from vigil.spec import parse_spec
from vigil_common import readmodel
from vigil_common.bus import Bus
from vigil_common.settings import Settings
from vigil_scheduler import alert_routes, queries
from vigil_scheduler.console import jobpage, spans, views
from vigil_scheduler.console.auth import COOKIE, ConsoleAuth, LoginRefused, check_origin, read_form, safe_next
from vigil_scheduler.console.live import WATCHED, console_events, job_changes
from vigil_scheduler.core import Scheduler
from vigil_scheduler.gateway import sse
from vigil_scheduler.gateway.auth import principal
from vigil_scheduler.gateway.params import JOB_ID, Attempt, DeviceIndex, JobId, NodeName, Step
from vigil_scheduler.gateway.parsing import off_loop
from vigil_scheduler.gateway.queue import may_wait, queue_entry, queue_of
from vigil_scheduler.principals import Principal

Pool = NamedDependency[asyncpg.Pool]
BusDep = NamedDependency[Bus]
SchedulerDep = NamedDependency[Scheduler]
SettingsDep = NamedDependency[Settings]
AuthDep = NamedDependency[ConsoleAuth]
ALERT_DELIVERIES = 10  # per route, on the alerts page
Points = Annotated[int, QueryParameter(ge=1, le=views.MAX_POINTS, description="points per curve")]
JobFilter = Annotated[str | None, QueryParameter(pattern=JOB_ID, description="only this job's events")]
ALL = 1000  # one page of the inventory is enough for a console view
EXAMPLE_SPEC = """name: tiny-gpt
resources: {nodes: 1, gpus_per_node: 2}
model: {preset: tiny}
train: {steps: 200}
"""


class LoginController(Controller):
    """The only console routes without a login (and the state colours' stylesheet the login page skips)."""

    @get("/login", include_in_schema=False)
    async def login_page(self, next_path: Annotated[str, QueryParameter(name="next")] = "/") -> Template:
        return Template("login.html", context={"next": safe_next(next_path), "error": None})

    @post("/login", include_in_schema=False)
    async def login(self, request: Request, auth: AuthDep) -> Response:
        check_origin(request)
        form = await read_form(request)
        next_path = safe_next(form.get("next", "/"))
        address = request.client.host if request.client else "unknown"
        try:
            cookie = await auth.login(address, form.get("token", ""), request.app.state.authenticator)
        except LoginRefused as exc:
            context = {"next": next_path, "error": str(exc)}
            return Template("login.html", context=context, status_code=exc.status_code, headers=exc.headers)
        response = Redirect(next_path, status_code=303)
        response.set_cookie(
            COOKIE, cookie, max_age=auth.session_s, httponly=True, samesite="strict", path="/"
        )
        return response

    @get("/console/states.css", include_in_schema=False)
    async def states_css(self) -> Response[str]:
        return Response(views.states_css(), media_type="text/css")


class ConsoleController(Controller):
    """Pages (guarded by the router: cookie or bearer token)."""

    include_in_schema = False

    @post("/logout")
    async def logout(self, request: Request, auth: AuthDep) -> Response:
        auth.sessions.revoke(request.cookies.get(COOKIE, ""))  # a copy of the cookie is dead too
        response = Redirect("/login", status_code=303)
        response.delete_cookie(COOKIE, path="/")
        return response

    @get("/")
    async def jobs(
        self,
        request: Request,
        pool: Pool,
        state_filter: Annotated[str | None, QueryParameter(name="state")] = None,
    ) -> Template:
        return Template("jobs.html", context=await _jobs_context(pool, principal(request), state_filter))

    @post("/jobs")
    async def submit(self, request: Request, pool: Pool, scheduler: SchedulerDep) -> Response:
        text = (await read_form(request)).get("spec", "")
        try:
            spec = await off_loop(request, parse_spec, text)  # as the API does: heartbeats go on
        except SpecError as exc:
            return await _refused(pool, request, text, exc)
        try:
            job, _ = await scheduler.submit(spec, principal(request))
        except SpecError as exc:  # over its quota, or a program this cluster does not run
            return await _refused(pool, request, text, exc)
        return Redirect(f"/jobs/{job.id}", status_code=303)

    @post("/jobs/{job_id:str}/cancel")
    async def cancel(self, request: Request, pool: Pool, scheduler: SchedulerDep, job_id: JobId) -> Response:
        try:
            await scheduler.cancel(job_id, principal(request))
        except Conflict as exc:
            context = {"job": await queries.job_detail(pool, job_id, principal(request)), "error": str(exc)}
            return Template("job.html", context=context, status_code=409)
        return Redirect(f"/jobs/{job_id}", status_code=303)

    @get("/jobs/{job_id:str}")
    async def job(self, request: Request, pool: Pool, scheduler: SchedulerDep, job_id: JobId) -> Template:
        """The frame (title, forms, empty tables): the page fills it from `job_data`. A queued job's place
        in the queue (position, why it waits, estimated start) is said in the frame."""
        job = await queries.job_detail(pool, job_id, principal(request))
        queued = None
        if may_wait(job):  # its place in the queue
            queued = await queue_entry(pool, scheduler.settings, principal(request), job_id)
        return Template("job.html", context={"job": job, "queue": queued, "error": None})

    @get("/jobs/{job_id:str}/trace")
    async def trace(
        self,
        request: Request,
        pool: Pool,
        settings: SettingsDep,
        job_id: JobId,
        step: Step = None,
        attempt: Attempt = None,
    ) -> Template:
        job = await queries.job_detail(pool, job_id, principal(request))
        if step is None:
            step = job["last_step"] or 0
        stored = await readmodel.step_phases(pool, job_id, step, attempt=attempt)
        traced = await anyio.to_thread.run_sync(
            spans.read_step_spans, settings.trace_file, job_id, step, attempt or _attempt_of(stored)
        )
        return Template(
            "trace.html",
            context={
                "job": job,
                "step": step,
                "attempt": _attempt_of(stored),
                "phases": [p for p, _ in views.PHASES],
                "stored": views.phase_bars(stored),
                "spans": views.phase_bars(traced) if traced else None,
                "trace_file": settings.trace_file,
                "trace_file_read": traced is not None,
            },
        )

    @get("/cluster")
    async def cluster(
        self, request: Request, pool: Pool, scheduler: SchedulerDep, color: FromQuery[str] = "utilization"
    ) -> Template:
        metric = color if color in views.GRID_METRICS else "utilization"
        viewer = principal(request)
        spares = scheduler.settings.hot_spares
        nodes, gpus = await asyncio.gather(
            queries.list_nodes(pool, viewer, limit=ALL, cursor=None, spares=spares),
            queries.list_gpus(pool, viewer, limit=ALL, cursor=None),
        )
        by_node: dict[str, list[dict[str, Any]]] = {}
        for d in gpus["items"]:
            d["cell"] = views.gpu_cell(metric, d)
            by_node.setdefault(d["node"], []).append(d)
        for n in nodes["items"]:
            n["gpus"] = by_node.get(n["name"], [])
            n["topology"] = views.topology(n["devices"])
            n["has_nvlink"] = any(d["nvlink_peers"] for d in n["devices"])
        return Template(
            "cluster.html", context={"nodes": nodes["items"], "metric": metric, "metrics": views.GRID_METRICS}
        )

    @get("/cluster/{node:str}/{index:int}")
    async def gpu(self, node: NodeName, index: DeviceIndex) -> Template:
        return Template("gpu.html", context={"node": node, "index": index})

    @get("/queue")
    async def queue(self, request: Request, scheduler: SchedulerDep) -> Template:
        """The queued jobs in queue order: position, why each waits, estimated start; teams' fair share."""
        found = await queue_of(scheduler.pool, scheduler.settings, principal(request))
        return Template("queue.html", context={"queue": found})

    @get("/alerts")
    async def alerts(self, request: Request, pool: Pool) -> Template:
        """The alert routes the viewer sees, each with its newest deliveries (status, attempts, error)."""
        viewer = principal(request)
        routes = await alert_routes.list_routes(pool, viewer)
        for route in routes:
            route["deliveries"] = await alert_routes.deliveries(pool, route["id"], viewer, ALERT_DELIVERIES)
        return Template("alerts.html", context={"routes": routes})

    @get("/incidents")
    async def incidents(self, request: Request, pool: Pool) -> Template:
        page = await readmodel.incidents(pool, limit=200, visible_to=queries.visibility(principal(request)))
        return Template("incidents.html", context={"incidents": page["items"]})


class ConsoleDataController(Controller):
    """JSON and event streams behind the pages (same guard)."""

    path = "/console"
    include_in_schema = False

    @get("/data/jobs/{job_id:str}")
    async def job_data(
        self, request: Request, pool: Pool, job_id: JobId, points: Points = views.DEFAULT_POINTS
    ) -> dict[str, Any]:
        """Everything the job page shows, in one document (`jobpage.job_document`)."""
        return await jobpage.job_document(pool, job_id, principal(request), points)

    @get("/data/gpus/{node:str}/{index:int}")
    async def gpu_history(self, pool: Pool, node: NodeName, index: DeviceIndex) -> dict[str, Any]:
        page = await readmodel.gpu_samples(pool, node=node, index=index, limit=1000)
        samples = list(reversed(page["items"]))
        return {
            "t": [s["occurred_at"].timestamp() for s in samples],
            "utilization_pct": [s["utilization_pct"] for s in samples],
            "memory_used_bytes": [s["memory_used_bytes"] for s in samples],
            "temperature_c": [s["temperature_c"] for s in samples],
            "power_w": [s["power_w"] for s in samples],
        }

    @get("/events")
    async def events(
        self,
        request: Request,
        bus: BusDep,
        pool: Pool,
        job: JobFilter = None,
        last_event_id: Annotated[str | None, HeaderParameter(name=sse.LAST_EVENT_ID)] = None,
    ) -> ServerSentEvent:
        """With `job`: that job page's `changed` events; without: state changes and incidents as they come,
        resumed after `Last-Event-ID` when the browser reconnects."""
        closing = request.app.state.closing
        viewer = principal(request)
        if job is not None:
            await queries.require_job(pool, job, viewer)  # a 404, not a stream that never says anything
            if await readmodel.job_version(pool, job) is None:
                raise NotFound(f"no job {job!r}")
            return ServerSentEvent(job_changes(pool, closing, job))
        resume_at = sse.parse_last_event_id(last_event_id, len(WATCHED))
        return ServerSentEvent(
            console_events(
                bus,
                closing,
                queries.Visible(pool, viewer),
                resume_at=resume_at,
                keepalive_s=request.app.state.sse_keepalive_s,
            )
        )


async def _refused(pool: asyncpg.Pool, request: Request, text: str, exc: SpecError) -> Template:
    """The jobs page again, with the spec as typed and what is wrong with it."""
    context = await _jobs_context(pool, principal(request), None)
    context.update(spec_text=text, spec_errors=exc.errors)
    return Template("jobs.html", context=context, status_code=422)


async def _jobs_context(pool: asyncpg.Pool, viewer: Principal, state: str | None) -> dict[str, Any]:
    state = state if state in set(JobState) else None
    page = await queries.list_jobs(pool, viewer, state=state, limit=200, cursor=None)
    counts = await readmodel.incident_counts(pool, [j["id"] for j in page["items"]])
    for j in page["items"]:
        j["incidents"] = counts.get(j["id"], 0)
        j["steps"] = j["spec"]["train"]["steps"]
    return {
        "jobs": page["items"],
        "state": state,
        "spec_text": EXAMPLE_SPEC,
        "spec_errors": [],
        "viewer": viewer,
    }


def _attempt_of(rows: list[dict[str, Any]]) -> int | None:
    return rows[0]["attempt"] if rows else None
