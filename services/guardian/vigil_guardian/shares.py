"""The shares of the jobs, as guardians divide them, and how one is taken up.

Guardians share the jobs. The jobs fall into `subjects.SHARES` shares by a hash of their id; VIGIL_JOBS
stores each event under its share's own subjects (`subjects.stored`: the stream's transform, nothing copied).
Each running guardian holds a fair part of the shares (`vigil_guardian.shares.Shares`: an advisory lock per
share in Postgres, SHARES / live guardians each), and judges each share it holds as one guardian judged
everything before: its own core, consumer, cursor and hang check. A share whose guardian is gone is taken
by another within VIGIL_TAKEOVER_S; a share given up (a guardian joined) stops being judged before its
lock is released, and the next holder restores it as a restarted guardian does.

First start. A share with no consumer and no saved state (a new deployment, or one started after its
jobs) replays the last `guardian_replay_s` of job events, so it judges a running job from its start;
jobs that ended within that window are not judged at all.


Taking a share up restores it (`restore`): its saved state and cursor, then a re-feed of each active
job's steps that its input has acknowledged into the detector windows, quietly (no decision: their
effect is in the saved state). A re-feed is not a replay, which re-runs a held step on the ranks.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import math
from collections.abc import Awaitable, Callable

import asyncpg

from vigil.events import (
    GpuSampled,
    JobStateChanged,
    StepCompleted,
    utcnow,
)
from vigil.jobstates import TERMINAL_STATES
from vigil_common import credentials, subjects
from vigil_common.bus import Bus, ConsumerSpec
from vigil_common.lease import PREFIX, SHARE_KEY, connection_settings
from vigil_common.origin import Origins
from vigil_common.service import wait_any
from vigil_common.settings import Settings
from vigil_guardian import store
from vigil_guardian.core import Guardian
from vigil_guardian.devices import Devices, owner
from vigil_guardian.inputs import cursor_key
from vigil_guardian.service import GuardianService
from vigil_guardian.state import Control
from vigil_guardian.verdict import Verdict
from vigil_guardian.watch import JobWatch

log = logging.getLogger(__name__)

REFEED_HORIZON_S = 3600.0  # the windows hold the last few dozen steps per rank: an hour rebuilds them


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


async def restore(service: GuardianService, bus: Bus, pool: asyncpg.Pool, replay_s: float) -> ConsumerSpec:
    """Load the share's saved state and rebuild each active job's windows from the steps its input has
    acknowledged; returns the input's spec (a first start: a bounded replay)."""
    share, spec = service.share, service.input
    saved = await store.load(pool, cursor_key(share), share)
    core = service.core
    for job_id in saved.finished:
        core.finish(job_id)
    for iid in saved.incidents:
        core.mark_published(iid)
    core.restore_devices(saved.devices)
    service._devices = core.device_levels()
    for job_id, snap in saved.jobs.items():
        core.jobs[job_id] = JobWatch(job_id, Control.restore(snap))
        service._saved[job_id] = snap
    service.judged = saved.cursor or 0
    state = await bus.consumer_state(spec)
    if state is None:
        if saved.jobs and saved.cursor is None:
            # State saved by a guardian of an earlier layout (before shares, one input for all jobs; or
            # reading VIGIL_SHARES, the copy): its cursor counts another stream's sequences. It judged up
            # to now, so this share starts at new events, as that one would have.
            return dataclasses.replace(spec, deliver_new=True)
        since = utcnow().timestamp() - replay_s
        ended = await _ended_since(bus, since, share)
        for job_id in ended:
            if job_id not in core.jobs:
                core.finish(job_id)
        log.info(
            "guardian: share %d: first start, replaying %.0fs of job events (%d jobs ended)",
            share,
            replay_s,
            len(ended),
        )
        return dataclasses.replace(spec, replay_s=replay_s)
    service.windowed = upto = state.acked
    refed = 0
    for watch in list(core.jobs.values()):
        refed += await refeed(bus, core, watch, upto, service.origins, share)
    if saved.jobs:
        log.info("guardian: share %d: restored %d jobs, refed %d steps", share, len(saved.jobs), refed)
    return spec


async def _ended_since(bus: Bus, since: float, share: int) -> set[str]:
    """The share's jobs whose last state change since `since` ended them."""
    last: dict[str, bool] = {}
    admit = Origins(bus).admit
    name = credentials.guardian_scan(share)
    async for event in bus.scan(name, subjects.CONTROL_STATUS, since=since, admit=admit):
        if isinstance(event, JobStateChanged) and event.job_id and subjects.share_of(event.job_id) == share:
            last[event.job_id] = event.to_state in TERMINAL_STATES
    return {job for job, ended in last.items() if ended}


async def refeed(bus: Bus, core: Guardian, watch: JobWatch, upto: int, origins: Origins, share: int) -> int:
    """Feed a job's step events (share input sequence <= `upto`) quietly: windows only, no decisions."""
    if upto <= 0:
        return 0
    since = max(watch.control.replay_from, utcnow().timestamp() - REFEED_HORIZON_S)
    fed = 0
    steps = subjects.job_steps(watch.job_id)
    name = credentials.guardian_scan(share)
    async for event in bus.scan(name, steps, since=since, upto=upto, admit=origins.admit):
        if isinstance(event, StepCompleted):  # all a step subject carries (`subjects.CARRIES`)
            core.on_event(event, event.occurred_at, quiet=True)
            fed += 1
    return fed


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


async def judge(service: GuardianService, settings: Settings, until: asyncio.Event) -> None:
    """Restore one share (saved state and cursor, as after a restart: a hand-over is one); judge its
    input until `until`."""
    bus = service.bus
    spec = await restore(service, bus, service.pool, settings.guardian_replay_s)
    async with asyncio.TaskGroup() as tasks:
        # a step or status event counts only from the node its launch placed it on
        tasks.create_task(
            bus.consume_batches(
                spec, lambda b: service.on_jobs(b, until), until, gather_s=0, admit=service.origins.admit
            )
        )
        tasks.create_task(service.hang_loop(until))
