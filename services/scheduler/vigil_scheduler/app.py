"""The app factory: the API (`gateway/`) and the web console (`console/`) on one server, with auth, error
mapping, body limit, OpenAPI, and a lifespan that puts the scheduler's pool, bus and core on `app.state`.

It sits above both folders: the console builds on the gateway's auth, errors and event streams, and the
gateway never imports the console (an import-linter contract in pyproject.toml)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

import asyncpg
from litestar import Litestar, Router
from litestar.datastructures import State
from litestar.di import Provide
from litestar.openapi import OpenAPIConfig
from litestar.openapi.spec import Components, SecurityScheme

from vigil_common.bus import Bus
from vigil_common.settings import Settings
from vigil_scheduler import console
from vigil_scheduler.core import Scheduler
from vigil_scheduler.gateway import openapi
from vigil_scheduler.gateway.alerts import AlertRouteController
from vigil_scheduler.gateway.allow import AllowEveryMethod
from vigil_scheduler.gateway.auth import bearer_guard
from vigil_scheduler.gateway.code import CodeController
from vigil_scheduler.gateway.controllers import (
    AuditController,
    ControlPlaneController,
    EventsController,
    HealthController,
    InventoryController,
    JobController,
)
from vigil_scheduler.gateway.errors import EXCEPTION_HANDLERS
from vigil_scheduler.gateway.guardian import GuardianController
from vigil_scheduler.gateway.queue import QueueController
from vigil_scheduler.gateway.users import MeController, TeamController, UserController
from vigil_scheduler.users import Authenticator

API_PREFIX = "/api/v1"


@dataclass(frozen=True)
class Deps:
    """What the gateway needs from the service that hosts it (owned and closed by that service)."""

    settings: Settings
    pool: asyncpg.Pool
    bus: Bus
    scheduler: Scheduler
    api_token: str
    closing: asyncio.Event = field(default_factory=asyncio.Event)  # set when the service stops
    # specs parsed at once, each in a thread: a burst of large bodies cannot hold the event loop
    parsing: asyncio.Semaphore = field(default_factory=lambda: asyncio.Semaphore(2))


def _from_state(name: str) -> Provide:
    def provide(state: State) -> object:
        return state[name]

    return Provide(provide, sync_to_thread=False)


def create_app(deps: Deps) -> Litestar:
    @asynccontextmanager
    async def lifespan(app: Litestar) -> AsyncIterator[None]:
        app.state.update(
            pool=deps.pool,
            bus=deps.bus,
            scheduler=deps.scheduler,
            api_token=deps.api_token,
            authenticator=Authenticator(deps.api_token, deps.pool),
            closing=deps.closing,
            parsing=deps.parsing,
            sse_keepalive_s=deps.settings.sse_keepalive_s,
        )
        try:
            yield
        finally:
            deps.closing.set()  # ends open event streams

    api = Router(
        API_PREFIX,
        route_handlers=[
            JobController,
            GuardianController,
            InventoryController,
            ControlPlaneController,
            EventsController,
            AuditController,
            MeController,
            UserController,
            TeamController,
            QueueController,
            CodeController,
            AlertRouteController,
        ],
        guards=[bearer_guard],
        security=[{"bearer": []}],
    )
    return Litestar(
        route_handlers=[api, HealthController, *console.console_routes(deps.settings)],
        template_config=console.template_config(),
        lifespan=[lifespan],
        dependencies={
            "pool": _from_state("pool"),
            "bus": _from_state("bus"),
            "scheduler": _from_state("scheduler"),
        },
        exception_handlers=EXCEPTION_HANDLERS,  # type: ignore[arg-type]
        middleware=[AllowEveryMethod()],  # OPTIONS lists every method of its path
        request_max_body_size=deps.settings.max_body_bytes,
        openapi_config=OpenAPIConfig(
            title="Vigil",
            version="1",
            description="Control plane for distributed LLM training: jobs, inventory, incidents, events.",
            path="/schema",
            render_plugins=openapi.render_plugins(),  # the models as pydantic describes them
            components=Components(security_schemes={"bearer": SecurityScheme(type="http", scheme="bearer")}),
        ),
        logging_config=None,  # the service configures logging
        debug=False,
    )
