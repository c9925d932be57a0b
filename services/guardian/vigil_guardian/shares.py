"""The shares of the jobs, as guardians divide them.

Guardians share the jobs. The jobs fall into `subjects.SHARES` shares by a hash of their id; VIGIL_JOBS
stores each event under its share's own subjects (`subjects.stored`: the stream's transform, nothing copied).
Each running guardian holds a fair part of the shares (`vigil_guardian.shares.Shares`: an advisory lock per
share in Postgres, SHARES / live guardians each), and judges each share it holds as one guardian judged
everything before: its own core, consumer, cursor and hang check (`GuardianService.run_share`). A share
whose guardian is gone is taken by another within VIGIL_TAKEOVER_S; a share given up (a guardian joined)
stops being judged before its lock is released, and the next holder restores it as a restarted guardian
does.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
from collections.abc import Awaitable, Callable

import asyncpg

from vigil.events import GpuSampled
from vigil_common import subjects
from vigil_common.lease import PREFIX, SHARE_KEY, connection_settings
from vigil_common.service import wait_any
from vigil_guardian.devices import Devices, owner
from vigil_guardian.service import GuardianService
from vigil_guardian.verdict import Verdict

log = logging.getLogger(__name__)


class Shares:
    """The shares of the jobs one guardian judges: `hold` runs `judge(share, stop_share)` for each share
    it holds, and sets `stop_share` (then waits for `judge` to return) before it gives the share up."""

    def __init__(self, database_url: str, takeover_s: float, count: int = subjects.SHARES) -> None:
        self.database_url, self.count = database_url, count
        self.check_s = max(takeover_s / 4, 0.1)
        self._settings = connection_settings("guardian", takeover_s)
        self.held: dict[int, tuple[asyncio.Task[None], asyncio.Event]] = {}

    async def hold(self, judge: Callable[[int, asyncio.Event], Awaitable[None]], stop: asyncio.Event) -> None:
        """Until `stop`: connect (that counts this guardian in), hold a fair part of the shares, give all
        up when the connection fails, connect again."""
        while not stop.is_set():
            try:
                conn = await asyncpg.connect(self.database_url, server_settings=self._settings, timeout=10)
            except (asyncpg.PostgresError, OSError, TimeoutError) as exc:
                log.warning("guardian: cannot reach Postgres for the shares' locks: %s", exc)
                await wait_any(stop, timeout_s=self.check_s)
                continue
            try:
                await self._divide(conn, judge, stop)
            finally:
                for share in sorted(self.held):
                    await self._give_up(conn, share, unlock=False)
                try:
                    await asyncio.wait_for(conn.close(), 5)
                except (asyncpg.PostgresError, OSError, TimeoutError):
                    conn.terminate()
            if not stop.is_set():
                log.warning("guardian: lost the shares' connection; judging nothing until it is back")

    async def _divide(
        self,
        conn: asyncpg.Connection,
        judge: Callable[[int, asyncio.Event], Awaitable[None]],
        stop: asyncio.Event,
    ) -> None:
        while not stop.is_set():
            try:
                live = await asyncio.wait_for(
                    conn.fetchval(
                        "SELECT count(*) FROM pg_stat_activity WHERE application_name LIKE $1",
                        f"{PREFIX}guardian-%",
                    ),
                    self.check_s * 2,
                )
            except (asyncpg.PostgresError, OSError, TimeoutError) as exc:
                log.error("guardian: the shares' connection failed (%s): giving them up", exc)
                return
            fair = math.ceil(self.count / max(live, 1))
            for share in sorted(self.held, reverse=True)[: max(len(self.held) - fair, 0)]:
                await self._give_up(conn, share)
            for share in range(self.count):
                if len(self.held) >= fair:
                    break
                if share not in self.held and await conn.fetchval(
                    "SELECT pg_try_advisory_lock($1)", SHARE_KEY + share
                ):
                    until = asyncio.Event()
                    task = asyncio.create_task(self._judging(judge, share, until), name=f"share-{share}")
                    self.held[share] = (task, until)
            await wait_any(stop, timeout_s=self.check_s)

    async def _judging(
        self, judge: Callable[[int, asyncio.Event], Awaitable[None]], share: int, until: asyncio.Event
    ) -> None:
        log.info("guardian: judging share %d", share)
        while not until.is_set():
            try:
                await judge(share, until)
            except Exception:
                log.exception("guardian: share %d failed; judging it again", share)
                await wait_any(until, timeout_s=1.0)

    async def _give_up(self, conn: asyncpg.Connection, share: int, *, unlock: bool = True) -> None:
        """Stop judging `share`, then release its lock (not before: never two judges of one share)."""
        task, until = self.held.pop(share)
        until.set()
        await asyncio.gather(task, return_exceptions=True)
        if unlock:
            with contextlib.suppress(asyncpg.PostgresError, OSError, TimeoutError):
                await asyncio.wait_for(conn.fetchval("SELECT pg_advisory_unlock($1)", SHARE_KEY + share), 5)
        log.info("guardian: gave up share %d", share)


def route(
    devices: Devices, samples: list[GpuSampled], held: dict[int, tuple[GuardianService, asyncio.Event]]
) -> dict[int, list[tuple[GpuSampled, Verdict]]]:
    """Judge each sample once (`devices`) and hand each verdict to the share held that owns it."""
    cores = {share: service.core for share, (service, _) in held.items()}
    handed: dict[int, list[tuple[GpuSampled, Verdict]]] = {}
    for sample in samples:
        verdict = devices.observe(sample)
        if verdict is not None and (share := owner(sample.node, sample.index, cores)) is not None:
            handed.setdefault(share, []).append((sample, verdict))
    return handed
