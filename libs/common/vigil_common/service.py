"""Running a service: settings built once, a stop event set by SIGINT/SIGTERM, a clean exit."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import signal
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass

import asyncpg
from opentelemetry.sdk.trace import TracerProvider

from vigil.errors import ConfigError
from vigil.paths import private_dir
from vigil_common import tracing
from vigil_common.bus import Bus
from vigil_common.confine import private_umask
from vigil_common.db import create_pool, migrate
from vigil_common.settings import Settings
from vigil_common.waiting import wait_any as wait_any  # services import it from here

ServiceMain = Callable[[Settings, asyncio.Event], Awaitable[None]]


def setup_logging(settings: Settings) -> None:
    logging.basicConfig(
        level=settings.log_level,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )


def install_stop_signals(stop: asyncio.Event) -> None:
    """SIGINT and SIGTERM set `stop` (a second Ctrl-C still interrupts, via the default handler)."""
    loop = asyncio.get_running_loop()

    def on_signal(sig: signal.Signals) -> None:
        logging.getLogger("vigil").info("%s received: stopping", sig.name)
        stop.set()
        loop.remove_signal_handler(sig)  # a second signal gets the default behaviour

    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, on_signal, sig)


# The collector's first threshold in a service process (Python's default is 700): telemetry and the
# guardian hold a batch of events at once (thousands, a few tracked objects each). With the default, young
# collections came many times a batch, promoted the batch in flight, and full collections followed every
# few batches: a third of telemetry's time in `vigil bench ingest`, and a pause of tens of ms wherever one
# fell. At 50,000 a batch is freed (by its reference counts) before a young collection sees it.
GC_THRESHOLD = (50_000, 10, 10)


def settle_heap() -> None:
    """For a long-running service, once its imports are done: what exists now (modules, classes,
    pydantic's validators) lives as long as the process, so it is frozen out of every collection
    (`gc.freeze`), and young collections wait for `GC_THRESHOLD` objects."""
    gc.collect()
    gc.freeze()
    gc.set_threshold(*GC_THRESHOLD)


def run_service(main: ServiceMain, settings: Settings) -> None:
    """Run `main(settings, stop)` until it returns; signals set `stop`. What it writes is owner-only
    (umask 077, the data dir 0700). The heap is settled first (`settle_heap`)."""
    private_umask()
    private_dir(settings.data_dir.resolve())
    setup_logging(settings)
    settle_heap()

    async def runner() -> None:
        stop = asyncio.Event()
        install_stop_signals(stop)
        await main(settings, stop)

    asyncio.run(runner())


def require_urls(settings: Settings, who: str, *, database: bool = True) -> None:
    """ConfigError naming each missing URL variable, and where else they can come from."""
    needed = {"VIGIL_NATS_URL": settings.nats_url}
    if database:
        needed["VIGIL_DATABASE_URL"] = settings.database_url
    if missing := [name for name, value in needed.items() if not value]:
        raise ConfigError(
            f"the {who} needs {' and '.join(missing)}: set {'them' if len(missing) > 1 else 'it'}, "
            "or start `vigil up` with the same "
            f"data dir ({settings.data_dir.resolve()}) and it is found there"
        )


@dataclass
class Connections:
    """What a service holds while it runs: its tracer provider, Postgres pool and bus."""

    provider: TracerProvider
    pool: asyncpg.Pool
    bus: Bus


@contextlib.asynccontextmanager
async def connect(
    settings: Settings, name: str, *, manage_streams: bool = False
) -> AsyncIterator[Connections]:
    """Tracing, a migrated Postgres pool and a bus with its streams, closed in reverse on exit.

    Only a service with `manage_streams` (the scheduler) updates the streams' configuration; the
    others create a missing one at most. Raises ConfigError when a URL is missing: a service run
    alone needs both (or `vigil up`).
    """
    require_urls(settings, name)
    provider = tracing.setup_tracing(name, trace_file=settings.trace_file)
    async with contextlib.AsyncExitStack() as stack:
        stack.callback(provider.shutdown)
        pool = await create_pool(settings.database_url, timeout_s=settings.connect_timeout_s)
        stack.push_async_callback(pool.close)
        await migrate(pool)
        bus = await Bus.connect(
            settings.nats_url,
            name=name,
            provider=provider,
            tls_ca=settings.nats_tls_ca,
            connect_timeout_s=settings.connect_timeout_s,
        )
        stack.push_async_callback(bus.close)
        await bus.ensure_streams(manage=manage_streams, replicas=settings.stream_replicas)
        yield Connections(provider, pool, bus)
