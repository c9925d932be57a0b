"""Who does what must never run twice: Postgres advisory locks, held on a connection of their own.

Any number of `vigil scheduler` processes may run with the same settings. One at a time, the holder of
the scheduler's lock (`Lease`) runs the bus consumers, the placement and node-lost loops and the outbox
relay (every scheduler serves the gateway). The others stand by and try for the lock every
`VIGIL_TAKEOVER_S / 4` seconds.

A lock is a session lock: it goes with its connection. A killed process's connection is closed by
its kernel at once; a host that vanishes is noticed by the server's TCP keepalives, which the lock's
connection asks to be short (`connection_settings`, about `takeover_s`). The holder checks its connection
every `takeover_s / 4` and stops its active work the moment it cannot (a server restart, a network
cut), so two schedulers are never active at once for longer than that check.

The guardians divide their work instead (`Shares`): one lock per share of the jobs
(`vigil_common.subjects.SHARES`), all of a guardian's on one connection, whose presence counts it among
the live guardians. Each takes its fair part (SHARES / live guardians, rounded up) of the free shares and
gives back what it holds beyond that, so a new guardian gets its part within two checks and the shares of
one that is gone are taken within `takeover_s`.
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

from vigil_common import subjects
from vigil_common.waiting import wait_any

log = logging.getLogger(__name__)

# One lock per role and database; a guardian share's is SHARE_KEY + share.
KEYS = {"scheduler": 0x56494749_4C534348, "guardian": 0x56494749_4C475244}  # "VIGILSCH", "VIGILGRD"
SHARE_KEY = KEYS["guardian"] + 1


PREFIX = "vigil-lease-"  # the application_name of a lease holder's connection


def instance() -> str:
    """This process, as `holders` names it: pid@host."""
    return f"{os.getpid()}@{socket.gethostname()}"


def application_name(role: str) -> str:
    return f"{PREFIX}{role}-{instance()}"[:63]  # Postgres keeps 63 bytes of it


@dataclass(frozen=True)
class Holder:
    role: str
    instance: str  # pid@host
    address: str | None  # where its connection comes from, as the server sees it
    since: datetime  # when its lock connection was made
    shares: tuple[int, ...] = ()  # a guardian's shares of the jobs


async def holders(conn: asyncpg.Connection | asyncpg.Pool) -> list[Holder]:
    """The active scheduler (a standby holds no connection) and every live guardian with the shares it
    holds (none: it has just started, or there are more guardians than shares). This database's only:
    the server's other databases (another deployment's, a test's) have holders of their own. A session
    of a role this one may not read (its `backend_start` reads as NULL) is not listed either."""
    rows = await conn.fetch(
        """SELECT a.application_name AS name, host(a.client_addr) AS address, a.backend_start AS since,
                  array_remove(array_agg((l.classid::bigint << 32) | l.objid::bigint), NULL) AS keys
           FROM pg_stat_activity a
           LEFT JOIN pg_locks l ON l.pid = a.pid AND l.locktype = 'advisory' AND l.granted
           WHERE a.application_name LIKE $1 AND a.datname = current_database()
             AND a.backend_start IS NOT NULL
           GROUP BY a.pid, a.application_name, a.client_addr, a.backend_start
           ORDER BY a.application_name""",
        PREFIX + "%",
    )
    found = []
    for r in rows:
        role, _, who = r["name"].removeprefix(PREFIX).partition("-")
        keys = set(r["keys"])
        if role == "scheduler" and KEYS[role] in keys:
            found.append(Holder(role, who, r["address"], r["since"]))
        elif role == "guardian":
            shares = tuple(sorted(k - SHARE_KEY for k in keys if 0 <= k - SHARE_KEY < subjects.SHARES))
            found.append(Holder(role, who, r["address"], r["since"], shares))
    return found


def connection_settings(role: str, takeover_s: float) -> dict[str, str]:
    """Short TCP keepalives (the server drops a silent peer after about `takeover_s`), and the name
    `holders` reads."""
    idle = max(int(takeover_s / 2), 1)
    return {
        "tcp_keepalives_idle": str(idle),
        "tcp_keepalives_interval": "1",
        "tcp_keepalives_count": str(max(int(takeover_s - idle), 1)),
        "application_name": application_name(role),
    }


class Lease:
    """A role's lock. `hold` runs `active(stop_active)` each time this process holds it."""

    def __init__(self, role: str, database_url: str, takeover_s: float) -> None:
        self.role, self.key = role, KEYS[role]
        self.database_url = database_url
        self.check_s = max(takeover_s / 4, 0.1)
        self._keepalive = connection_settings(role, takeover_s)

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
