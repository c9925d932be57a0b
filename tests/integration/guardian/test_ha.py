"""Guardians share the jobs: two or three `vigil guardian` processes on one database and bus divide the
shares (`vigil_guardian.shares.Shares`). One is killed (SIGKILL) mid-job: its shares, with a NaN and a hang in
jobs of those shares, are judged by the survivor within VIGIL_TAKEOVER_S, exactly once; a guardian that
comes back takes its part again while judging goes on."""

from __future__ import annotations

import math
import time
import uuid
from collections.abc import AsyncIterator
from pathlib import Path

import asyncpg
import nats.js.errors
import pytest

from tests.helpers import NEVER_HUNG, ServiceProcess, eventually, launch_on, step_completed, stored
from tests.integration.scheduler.conftest import fresh_database
from vigil.events import IncidentRaised, RankStarted, StepCompleted
from vigil_common import lease, subjects
from vigil_common.bus import Bus
from vigil_guardian import service as guardian

pytestmark = [pytest.mark.integration, pytest.mark.ha]

TAKEOVER_S = 3.0
NODE = "ha-n1"
HALF = subjects.SHARES // 2


def start_guardian(database_url: str, nats_url: str, data_dir: Path, name: str) -> ServiceProcess:
    env = {
        "VIGIL_DATABASE_URL": database_url,
        "VIGIL_NATS_URL": nats_url,
        "VIGIL_DATA_DIR": str(data_dir / name),
        "VIGIL_TAKEOVER_S": str(TAKEOVER_S),
    }
    return ServiceProcess("guardian", env, data_dir / f"{name}.log")


@pytest.fixture
async def db(database_url: str) -> str:
    return await fresh_database(database_url)


@pytest.fixture
async def guardians(db: str, nats_url: str, tmp_path: Path) -> AsyncIterator[list[ServiceProcess]]:
    made: list[ServiceProcess] = []
    yield made
    for g in made:
        g.stop()


async def shares(db: str) -> dict[int, tuple[int, ...]]:
    """pid -> the shares that guardian holds (`vigil_common.lease.holders`)."""
    conn = await asyncpg.connect(db)
    try:
        found = [h for h in await lease.holders(conn) if h.role == "guardian"]
    finally:
        await conn.close()
    return {int(h.instance.split("@")[0]): h.shares for h in found}


def holding(db: str, *expected: tuple[ServiceProcess, int]):  # type: ignore[no-untyped-def]
    """A check: each guardian holds that many shares (and is alive)."""

    async def check() -> bool:
        for g, _ in expected:
            assert g.proc.poll() is None, g.log.read_text()[-3000:]
        held = await shares(db)
        return all(len(held.get(g.proc.pid, ())) == n for g, n in expected)

    return check


def step(job_id: str, k: int, rank: int, loss: float) -> StepCompleted:
    return step_completed(job_id, k, rank, loss=loss, node=NODE)


async def settled(bus: Bus) -> bool:
    """Every share's input exists and is judged to its end."""
    for spec in guardian.INPUTS:
        try:
            info = await bus.js.consumer_info(spec.stream.name, spec.durable)
        except nats.js.errors.NotFoundError:
            return False  # not made yet
        if info.num_pending or info.num_ack_pending:
            return False
    return True


def job_in(held: tuple[int, ...]) -> str:
    """A new job id in one of the shares `held`."""
    while True:
        job_id = "j-ha-" + uuid.uuid4().hex[:8]
        if subjects.share_of(job_id) in held:
            return job_id


async def running_job(bus: Bus, job_id: str, steps: int = 6, **guardian_spec: object) -> str:
    """A two-rank job on NODE, launched, started, with `steps` clean steps; never judged hung unless
    `guardian_spec` sets its hang limits."""
    await launch_on(bus, job_id, {0: NODE, 1: NODE}, guardian=NEVER_HUNG | guardian_spec)
    for rank in (0, 1):
        started = RankStarted(job_id=job_id, attempt=1, rank=rank, node=NODE, pid=100 + rank, log_path="-")
        await bus.publish(subjects.status(job_id, NODE), started)
    for k in range(steps):
        for rank in (0, 1):
            await bus.publish(subjects.step(job_id, NODE), step(job_id, k, rank, 3.0 - 0.01 * k))
    return job_id


async def nan_at(bus: Bus, job_id: str, k: int = 6) -> None:
    await bus.publish(subjects.step(job_id, NODE), step(job_id, k, 0, 2.9))
    await bus.publish(subjects.step(job_id, NODE), step(job_id, k, 1, math.nan))


async def two_guardians(
    db: str, nats_url: str, tmp_path: Path, guardians: list[ServiceProcess]
) -> tuple[ServiceProcess, ServiceProcess]:
    first = start_guardian(db, nats_url, tmp_path, "first")
    guardians.append(first)
    await eventually(holding(db, (first, subjects.SHARES)), timeout=60, what="the first guardian holding all")
    second = start_guardian(db, nats_url, tmp_path, "second")
    guardians.append(second)
    await eventually(holding(db, (first, HALF), (second, HALF)), timeout=60, what="the shares divided")
    return first, second


async def test_a_killed_guardians_jobs_are_judged_by_the_other_exactly_once(
    db: str, nats_url: str, bus: Bus, guardians: list[ServiceProcess], tmp_path: Path
) -> None:
    first, second = await two_guardians(db, nats_url, tmp_path, guardians)
    held = await shares(db)
    a = await running_job(bus, job_in(held[first.proc.pid]))  # the first's: a NaN after it is killed
    b = await running_job(bus, job_in(held[second.proc.pid]))  # the second's: judged on, no pause
    quiet = {"hang_timeout_s": 6.0, "hang_step_multiple": 1000.0}
    h = await running_job(bus, job_in(held[first.proc.pid]), **quiet)  # the first's: goes silent
    await eventually(lambda: settled(bus), timeout=30, what="the clean steps judged")

    async with bus.watch(subjects.incident(a), subjects.incident(b), subjects.incident(h)) as incidents:
        first.kill()
        killed = time.monotonic()
        await nan_at(bus, b)
        await nan_at(bus, a)
        seen: dict[str, tuple[IncidentRaised, float]] = {}
        while len(seen) < 3:
            incident = await incidents.next(TAKEOVER_S + 30)
            assert isinstance(incident, IncidentRaised), incident
            assert incident.job_id not in seen, f"judged twice: {incident}"
            seen[incident.job_id or ""] = (incident, time.monotonic() - killed)
        await eventually(holding(db, (second, subjects.SHARES)), timeout=30, what="the second holding all")
        await eventually(lambda: settled(bus), timeout=30, what="the second judging all")
    for job, kind in ((a, "nan"), (b, "nan"), (h, "hang")):
        assert seen[job][0].kind == kind, seen[job]
    print(
        f"guardian hand-over (takeover {TAKEOVER_S}s): the killed one's NaN judged {seen[a][1]:.2f}s and "
        f"its hang {seen[h][1]:.2f}s after SIGKILL; the survivor's own NaN {seen[b][1]:.2f}s"
    )
    assert seen[a][1] <= TAKEOVER_S + 10
    assert seen[b][1] <= 2.0  # the survivor's shares are not paused by the hand-over
    for job in (a, b, h):
        assert await stored(bus, subjects.INCIDENTS, subjects.incident(job)) == 1, job
        assert await stored(bus, subjects.COMMANDS, subjects.cmd(job)) >= 1, job


async def test_guardians_restarted_one_after_the_other_judge_every_fault_once(
    db: str, nats_url: str, bus: Bus, guardians: list[ServiceProcess], tmp_path: Path
) -> None:
    first, second = await two_guardians(db, nats_url, tmp_path, guardians)
    held = await shares(db)
    a = await running_job(bus, job_in(held[first.proc.pid]))
    b = await running_job(bus, job_in(held[second.proc.pid]))
    await eventually(lambda: settled(bus), timeout=30, what="the clean steps judged")

    first.kill()  # fault on a (the first's share), judged by the second
    await nan_at(bus, a)
    await eventually(
        holding(db, (second, subjects.SHARES)), timeout=TAKEOVER_S + 10, what="the second taking all"
    )
    await eventually(
        lambda: stored(bus, subjects.INCIDENTS, subjects.incident(a)), timeout=30, what="a's NaN"
    )

    third = start_guardian(db, nats_url, tmp_path, "third")  # comes back: takes its part again
    guardians.append(third)
    for k in range(6, 12):  # judging goes on while the shares are divided again
        for rank in (0, 1):
            await bus.publish(subjects.step(b, NODE), step(b, k, rank, 2.9 - 0.01 * k))
    await eventually(holding(db, (second, HALF), (third, HALF)), timeout=60, what="the shares divided again")
    await eventually(lambda: settled(bus), timeout=30, what="the two judging all")
    assert await stored(bus, subjects.INCIDENTS, subjects.incident(b)) == 0  # clean steps: nothing raised

    held = await shares(db)
    moved = subjects.share_of(b) in held[third.proc.pid]
    second.kill()  # fault on b, judged by the third, which must not judge a's NaN again
    await nan_at(bus, b, 12)
    await eventually(
        holding(db, (third, subjects.SHARES)), timeout=TAKEOVER_S + 10, what="the third taking all"
    )
    await eventually(
        lambda: stored(bus, subjects.INCIDENTS, subjects.incident(b)), timeout=30, what="b's NaN"
    )
    await eventually(lambda: settled(bus), timeout=30, what="the third judging all")
    for job in (a, b):
        assert await stored(bus, subjects.INCIDENTS, subjects.incident(job)) == 1, job
        assert await stored(bus, subjects.COMMANDS, subjects.cmd(job)) == 1, job
    print(f"b's share moved to the returning guardian: {moved}")
