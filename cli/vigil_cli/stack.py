"""The whole stack in one process: infrastructure (embedded or the user's), migrations, services.

`vigil up` and `vigil demo` use it; so do end-to-end tests. Services are the same code that
runs alone (`vigil scheduler`, ...): each exposes `run(settings, stop)`.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import importlib
import logging
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

from vigil.errors import ConfigError, first_error
from vigil.paths import private_dir
from vigil_cli.services import SERVICES, nats_user
from vigil_common import credentials
from vigil_common.bus import Bus
from vigil_common.db import create_pool, migrate
from vigil_common.embedded import EmbeddedNats, EmbeddedPostgres
from vigil_common.endpoints import write_endpoints
from vigil_common.settings import Settings
from vigil_common.token import ensure_token

log = logging.getLogger("vigil.stack")


@dataclass
class Infra:
    """Where the stack's NATS and Postgres are, and what this process started."""

    settings: Settings
    embedded: list[str] = field(default_factory=list)
    # NATS URL per role (see vigil_common.credentials) when this process started NATS; else empty and
    # every service uses settings.nats_url.
    role_urls: dict[str, str] = field(default_factory=dict)

    def settings_for(self, service: str) -> Settings:
        """The settings a service runs with: its own NATS user's URL where there are users
        (`vigil_cli.services.nats_user`, as when it runs alone)."""
        if not self.role_urls:
            return self.settings
        user = nats_user(service, self.settings.node_name)
        return self.settings.model_copy(update={"nats_url": self.role_urls[user]})


def _lock_data_dir(data_dir: Path) -> IO[str]:
    private_dir(data_dir)  # checkpoints, logs, the token and the cache: the owner's alone
    handle = (data_dir / ".lock").open("w")
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError as exc:
        handle.close()
        raise ConfigError(
            f"another `vigil up` is using {data_dir}; stop it, or set VIGIL_DATA_DIR to another folder"
        ) from exc
    return handle


@contextlib.asynccontextmanager
async def infrastructure(settings: Settings) -> AsyncIterator[Infra]:
    """NATS and Postgres (embedded unless URLs are set), streams and migrations ready."""
    data_dir = settings.data_dir.resolve()
    with contextlib.ExitStack() as stack:
        stack.enter_context(_lock_data_dir(data_dir))
        embedded = []
        role_urls: dict[str, str] = {}
        nats_url, database_url = settings.nats_url, settings.database_url
        if not (nats_url and database_url):
            # One password per NATS role and Postgres's, kept 0600 in the data dir across restarts.
            creds = credentials.load_or_create(data_dir / credentials.CREDENTIALS_FILE, [settings.node_name])
        shown_nats, shown_db = nats_url, database_url
        if not nats_url:
            nats = stack.enter_context(EmbeddedNats(data_dir / "nats", users=creds.nats))
            nats_url, shown_nats = nats.url, nats.bare_url
            role_urls = {role: nats.url_for(role) for role in creds.nats}
            embedded.append("nats")
        if not database_url:
            pg = stack.enter_context(
                EmbeddedPostgres(
                    data_dir / "postgres", password=creds.postgres, app_password=creds.postgres_app
                )
            )
            database_url, shown_db = pg.url, pg.bare_url
            embedded.append("postgres")
        write_endpoints(settings, shown_nats, shown_db)
        stack.callback(lambda: (data_dir / "endpoints.json").unlink(missing_ok=True))
        settings = settings.model_copy(
            update={
                "nats_url": nats_url,
                "database_url": database_url,
                "api_token": ensure_token(settings),
                # One process hosts everything: when it stops, no rank may be left behind.
                "worker_end_ranks_on_stop": True,
            }
        )
        bus = await Bus.connect(nats_url, "vigil-up")
        try:
            await bus.ensure_streams(replicas=settings.stream_replicas)
        finally:
            await bus.close()
        pool = await create_pool(database_url)
        try:
            await migrate(pool)
        finally:
            await pool.close()
        yield Infra(settings=settings, embedded=embedded, role_urls=role_urls)


async def run_services(
    settings: Settings | Infra, stop: asyncio.Event, services: Sequence[str] = SERVICES
) -> None:
    """Run every service until `stop` is set. If one fails, `stop` is set: the others stop as on Ctrl-C
    (cleanly, not cancelled), and then its failure is raised (in an ExceptionGroup, as a TaskGroup would).

    Given the `Infra`, each service connects to NATS with its own role's credential."""
    infra = settings if isinstance(settings, Infra) else Infra(settings=settings)
    mains = [importlib.import_module(name).run for name in services]
    failed: list[Exception] = []

    async def guarded(name: str, main: object) -> None:
        try:
            await main(infra.settings_for(name), stop)  # type: ignore[operator]
        except Exception as exc:
            if (error := first_error(exc)) is not None:  # a setting, a server: one line, no traceback
                log.error("service %s failed; stopping the stack: %s", name, error)
            else:  # a bug: its traceback
                log.exception("service %s failed; stopping the stack", name)
            failed.append(exc)
            stop.set()

    async with asyncio.TaskGroup() as group:
        for name, main in zip(services, mains, strict=True):
            group.create_task(guarded(name, main), name=name)
    if failed:
        raise ExceptionGroup("a service failed", failed)
