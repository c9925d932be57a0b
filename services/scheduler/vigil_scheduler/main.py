"""The scheduler service: the Litestar gateway, served by every scheduler process, and, in the one that
holds the scheduling lock (`vigil_common.lease`), the bus consumers, the placement, node-lost and transition
sweeper loops and the outbox relay; all until `stop` is set."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
from collections.abc import Iterator

import uvicorn

from vigil.errors import ConfigError
from vigil_common import subjects
from vigil_common.bus import Bus, ConsumerSpec
from vigil_common.lease import Lease
from vigil_common.origin import Origins
from vigil_common.service import connect as service_connect
from vigil_common.settings import Settings
from vigil_common.token import ensure_token
from vigil_common.waiting import unless_stopped
from vigil_scheduler import code_packs, users
from vigil_scheduler.app import Deps, create_app
from vigil_scheduler.core import Scheduler
from vigil_scheduler.handlers import BUS_NAME, Handlers
from vigil_scheduler.outbox import Relay
from vigil_scheduler.principals import load_users_file

log = logging.getLogger(__name__)

HEARTBEATS = ConsumerSpec(
    stream=subjects.NODES,
    durable="scheduler-heartbeats",
    filter_subject=subjects.ALL_HEARTBEATS,
    deliver_new=True,
)
STATUS = ConsumerSpec(stream=subjects.JOBS, durable="scheduler-status", filter_subject=subjects.ALL_STATUS)
COMMANDS = ConsumerSpec(
    stream=subjects.COMMANDS, durable="scheduler-commands", filter_subject=subjects.ALL_CMDS
)
INCIDENTS = ConsumerSpec(
    stream=subjects.INCIDENTS, durable="scheduler-incidents", filter_subject=subjects.ALL_INCIDENTS
)


class _Server(uvicorn.Server):
    """uvicorn without its own signal handling: the service's stop event ends it."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


async def run(settings: Settings, stop: asyncio.Event) -> None:
    users_file = load_users_file(settings.users_file) if settings.users_file else None  # a bad one: now
    async with service_connect(settings, BUS_NAME, manage_streams=True) as conn:
        provider, pool, bus = conn.provider, conn.pool, conn.bus
        relay = Relay(pool, bus, provider)
        scheduler = Scheduler(settings, pool, relay, provider, presence=bus.presence)
        handlers = Handlers(scheduler)
        if users_file is not None:  # before the gateway answers: its tokens count at once
            async with pool.acquire() as db, db.transaction():
                await users.sync_file(db, users_file)
        deps = Deps(settings, pool, bus, scheduler, ensure_token(settings))
        app = create_app(deps)
        server = _Server(
            uvicorn.Config(
                app,
                host=settings.http_host,
                port=settings.http_port,
                log_config=None,
                access_log=False,
                lifespan="on",
                timeout_graceful_shutdown=3,
            )
        )
        lease = Lease("scheduler", settings.database_url or "", settings.takeover_s)

        async def active(until: asyncio.Event) -> None:
            await _active(scheduler, relay, handlers, bus, until)

        async with asyncio.TaskGroup() as tasks:
            tasks.create_task(lease.hold(active, stop))
            tasks.create_task(_serve(server, deps.closing, stop))  # every scheduler answers
        log.info("scheduler stopped")


async def _active(
    scheduler: Scheduler, relay: Relay, handlers: Handlers, bus: Bus, until: asyncio.Event
) -> None:
    """What one scheduler at a time runs (`vigil_common.lease`): consumers, loops, the outbox relay."""
    await scheduler.start()  # nodes get a full lost-after window from the takeover
    scheduler.active = True
    try:
        async with asyncio.TaskGroup() as tasks:
            tasks.create_task(relay.run(until))
            tasks.create_task(scheduler.liveness_loop(until))
            tasks.create_task(scheduler.placement_loop(until))
            tasks.create_task(
                handlers.outcomes.sweep_loop(until)
            )  # no job stays in a transition past the bound
            tasks.create_task(bus.consume_batches(HEARTBEATS, handlers.heartbeats, until))
            # a rank's start or exit counts only from the node its launch placed it on
            tasks.create_task(bus.consume(STATUS, handlers.status, until, admit=Origins(bus).admit))
            tasks.create_task(bus.consume(COMMANDS, handlers.commands, until))
            tasks.create_task(bus.consume(INCIDENTS, handlers.incidents, until))
            tasks.create_task(code_packs.sweep_loop(scheduler.pool, bus, scheduler.settings, until))
    finally:
        scheduler.active = False


async def _serve(server: uvicorn.Server, closing: asyncio.Event, stop: asyncio.Event) -> None:
    """Serve HTTP until `stop`; a server that cannot start stops the whole service."""
    host, port = server.config.host, server.config.port
    try:
        # bound here, not by uvicorn: uvicorn ends the process (sys.exit) when the port is taken
        listening = socket.create_server(
            (host, port), family=socket.AF_INET6 if ":" in host else socket.AF_INET
        )
    except OSError as exc:
        stop.set()
        why = os.strerror(exc.errno) if exc.errno else str(exc)
        raise ConfigError(
            f"the gateway cannot listen on {host}:{port} ({why}): set VIGIL_HTTP_PORT to a free port, "
            "or VIGIL_HTTP_HOST to an address of this machine"
        ) from exc
    # asyncio sets TCP_NODELAY only on sockets it made itself: without it every response waits ~40 ms for
    # the client's delayed ACK (Nagle). Accepted connections inherit it on Linux.
    listening.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    serving = asyncio.create_task(server.serve(sockets=[listening]))
    try:
        # waits on the server without cancelling it: on stop it shuts down gracefully, below
        await unless_stopped(asyncio.wait({serving}), stop)
        if serving.done() and not stop.is_set():
            stop.set()
            serving.result()
            raise ConfigError(f"the gateway stopped: could not serve on {host}:{port}")
    except SystemExit as exc:  # uvicorn exits when it cannot start
        stop.set()
        raise ConfigError(f"the gateway cannot serve on {host}:{port}") from exc
    finally:
        closing.set()  # ends open event streams, so the graceful shutdown is quick
        server.should_exit = True
        with contextlib.suppress(SystemExit):
            await serving
        listening.close()
