"""Which process of a role is active: a Postgres advisory lock, held on a connection of its own.

Any number of `vigil scheduler` (or `vigil guardian`) processes may run with the same settings. One at
a time per role, the holder of the role's lock, runs what must never run twice: for the scheduler the
bus consumers, the placement and node-lost loops and the outbox relay (every scheduler serves the
gateway); for the guardian all of its judging. The others stand by and try for the lock every
`VIGIL_TAKEOVER_S / 4` seconds.

The lock is a session lock: it goes with its connection. A killed process's connection is closed by
its kernel at once; a host that vanishes is noticed by the server's TCP keepalives, which the lock's
connection asks to be short (`_KEEPALIVE`, about `takeover_s`). The holder checks its connection
every `takeover_s / 4` and stops its active work the moment it cannot (a server restart, a network
cut), so two schedulers are never active at once for longer than that check.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from datetime import datetime

import asyncpg

from vigil_common.service import wait_any

log = logging.getLogger(__name__)

# One lock per role and database.
KEYS = {"scheduler": 0x56494749_4C534348, "guardian": 0x56494749_4C475244}  # "VIGILSCH", "VIGILGRD"


_PREFIX = "vigil-lease-"


def instance() -> str:
    """This process, as `holders` names it: pid@host."""
    return f"{os.getpid()}@{socket.gethostname()}"


def application_name(role: str) -> str:
    return f"{_PREFIX}{role}-{instance()}"[:63]  # Postgres keeps 63 bytes of it


@dataclass(frozen=True)
class Holder:
    role: str
    instance: str  # pid@host
    address: str | None  # where its connection comes from, as the server sees it
    since: datetime  # when its lock connection was made


async def holders(conn: asyncpg.Connection | asyncpg.Pool) -> list[Holder]:
    """Who holds each role's lock now (a standby holds no connection, so only the active ones)."""
    rows = await conn.fetch(
        """SELECT a.application_name AS name, host(a.client_addr) AS address, a.backend_start AS since
           FROM pg_locks l JOIN pg_stat_activity a ON a.pid = l.pid
           WHERE l.locktype = 'advisory' AND l.granted AND a.application_name LIKE $1
           ORDER BY a.application_name""",
        _PREFIX + "%",
    )
    found = []
    for r in rows:
        role, _, who = r["name"].removeprefix(_PREFIX).partition("-")
        if role in KEYS:
            found.append(Holder(role, who, r["address"], r["since"]))
    return found


class Lease:
    """A role's lock. `hold` runs `active(stop_active)` each time this process holds it."""

    def __init__(self, role: str, database_url: str, takeover_s: float) -> None:
        self.role, self.key = role, KEYS[role]
        self.database_url = database_url
        self.check_s = max(takeover_s / 4, 0.1)
        idle = max(int(takeover_s / 2), 1)
        # The server drops a silent peer after idle + interval * count seconds (about takeover_s).
        self._keepalive = {
            "tcp_keepalives_idle": str(idle),
            "tcp_keepalives_interval": "1",
            "tcp_keepalives_count": str(max(int(takeover_s - idle), 1)),
            "application_name": application_name(role),  # who holds it, for `holders`
        }

    async def hold(self, active: Callable[[asyncio.Event], Awaitable[None]], stop: asyncio.Event) -> None:
        """Until `stop`: wait for the lock, run `active` while it is held (its event is set when the lock
        is lost or `stop` is), stand by again."""
        while not stop.is_set():
            conn = await self._acquire(stop)
            if conn is None:
                return
            log.info("%s: active (holds the %s lock)", self.role, self.role)
            stop_active = asyncio.Event()
            try:
                async with asyncio.TaskGroup() as tasks:
                    tasks.create_task(self._keep(conn, stop, stop_active))
                    tasks.create_task(active(stop_active))
            finally:
                await self._release(conn)
            if not stop.is_set():
                log.warning("%s: lost the %s lock; standing by", self.role, self.role)

    async def _acquire(self, stop: asyncio.Event) -> asyncpg.Connection | None:
        announced = False
        while not stop.is_set():
            conn: asyncpg.Connection | None = None
            try:
                conn = await asyncpg.connect(self.database_url, server_settings=self._keepalive, timeout=10)
                if await conn.fetchval("SELECT pg_try_advisory_lock($1)", self.key):
                    return conn
            except (asyncpg.PostgresError, OSError, TimeoutError) as exc:
                log.warning("%s: cannot try the %s lock: %s", self.role, self.role, exc)
            if conn is not None:
                await conn.close()
            if not announced:
                log.info("%s: standing by (another %s holds the lock)", self.role, self.role)
                announced = True
            await wait_any(stop, timeout_s=self.check_s)
        return None

    async def _keep(self, conn: asyncpg.Connection, stop: asyncio.Event, stop_active: asyncio.Event) -> None:
        """Set `stop_active` on `stop`, or as soon as the lock's connection fails."""
        try:
            while not stop.is_set():
                await wait_any(stop, timeout_s=self.check_s)
                if stop.is_set():
                    break
                try:
                    await asyncio.wait_for(conn.fetchval("SELECT 1"), self.check_s * 2)
                except (asyncpg.PostgresError, OSError, TimeoutError) as exc:
                    log.error("%s: the lock's connection failed (%s): stopping", self.role, exc)
                    break
        finally:
            stop_active.set()

    async def _release(self, conn: asyncpg.Connection) -> None:
        try:
            await asyncio.wait_for(conn.close(), 5)
        except (asyncpg.PostgresError, OSError, TimeoutError):
            conn.terminate()
