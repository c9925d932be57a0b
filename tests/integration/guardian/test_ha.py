"""Two `vigil guardian` processes on one database and bus: one judges (it holds the guardian's lock,
`vigil_common.lease`), the other stands by. The judging one is killed (SIGKILL) mid-job; a NaN on that job
afterwards is judged by the other, within VIGIL_TAKEOVER_S: exactly one incident, one rollback."""

from __future__ import annotations

import math
import time
import uuid
from collections.abc import AsyncIterator
from pathlib import Path

import asyncpg
import nats.js.errors
import pytest

from tests.helpers import ServiceProcess, eventually, launch_on
from tests.integration.scheduler.conftest import fresh_database
from vigil_common import lease, subjects
from vigil_common.bus import Bus
from vigil_common.events import IncidentRaised, RankStarted, StepCompleted
from vigil_guardian import main as guardian

pytestmark = [pytest.mark.integration, pytest.mark.ha]

TAKEOVER_S = 3.0
NODE = "ha-n1"


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


async def lock_holder(db: str) -> int | None:
    """The pid of the guardian that holds the lock (`vigil_common.lease.holders`)."""
    conn = await asyncpg.connect(db)
    try:
        found = [h for h in await lease.holders(conn) if h.role == "guardian"]
    finally:
        await conn.close()
    return int(found[0].instance.split("@")[0]) if found else None


def step(job_id: str, k: int, rank: int, loss: float) -> StepCompleted:
    return StepCompleted(
        job_id=job_id, attempt=1, rank=rank, node=NODE, step=k, loss=loss, local_finite=math.isfinite(loss),
        grad_norm=1.0, lr=1e-3, tokens=100, tokens_per_s=1000.0, step_time_s=0.1, comm_time_s=0.01,
        data_position=k,
    )  # fmt: skip


async def settled(bus: Bus) -> bool:
    try:
        info = await bus.js.consumer_info(subjects.JOBS.name, guardian.INPUT.durable)
    except nats.js.errors.NotFoundError:
        return False  # not made yet by the guardian that judges
    return info.num_pending == 0 and info.num_ack_pending == 0


async def running_job(bus: Bus, steps: int = 6) -> str:
    """A two-rank job on NODE, launched, started, with `steps` clean steps."""
    job_id = "j-ha-" + uuid.uuid4().hex[:8]
    await launch_on(bus, job_id, {0: NODE, 1: NODE})
    for rank in (0, 1):
        started = RankStarted(job_id=job_id, attempt=1, rank=rank, node=NODE, pid=100 + rank, log_path="-")
        await bus.publish(subjects.status(job_id, NODE), started)
    for k in range(steps):
        for rank in (0, 1):
            await bus.publish(subjects.step(job_id, NODE), step(job_id, k, rank, 3.0 - 0.01 * k))
    return job_id


async def stored(bus: Bus, stream: subjects.StreamSpec, subject: str) -> int:
    info = await bus.js.stream_info(stream.name, subjects_filter=subject)
    return (info.state.subjects or {}).get(subject, 0)


async def test_guardians_restarted_one_after_the_other_judge_every_fault_once(
    db: str, nats_url: str, bus: Bus, guardians: list[ServiceProcess], tmp_path: Path
) -> None:
    first = start_guardian(db, nats_url, tmp_path, "first")
    guardians.append(first)
    await eventually(lambda: _holds(db, first), timeout=60, what="the first guardian holding the lock")
    second = start_guardian(db, nats_url, tmp_path, "second")
    guardians.append(second)
    a, b = await running_job(bus), await running_job(bus)
    await eventually(lambda: settled(bus), timeout=30, what="the clean steps judged")

    first.kill()  # fault on a, judged by the second
    await bus.publish(subjects.step(a, NODE), step(a, 6, 0, 2.9))
    await bus.publish(subjects.step(a, NODE), step(a, 6, 1, math.nan))
    await eventually(lambda: _holds(db, second), timeout=TAKEOVER_S + 10, what="the second taking over")
    await eventually(
        lambda: stored(bus, subjects.INCIDENTS, subjects.incident(a)), timeout=30, what="a's NaN"
    )
    await eventually(lambda: settled(bus), timeout=30, what="the second judging all")

    third = start_guardian(db, nats_url, tmp_path, "third")  # a replacement, standing by
    guardians.append(third)
    second.kill()  # fault on b, judged by the third, which must not judge a's NaN again
    await bus.publish(subjects.step(b, NODE), step(b, 6, 0, 2.9))
    await bus.publish(subjects.step(b, NODE), step(b, 6, 1, math.nan))
    await eventually(lambda: _holds(db, third), timeout=60, what="the third taking over")
    await eventually(
        lambda: stored(bus, subjects.INCIDENTS, subjects.incident(b)), timeout=30, what="b's NaN"
    )
    await eventually(lambda: settled(bus), timeout=30, what="the third judging all")
    for job in (a, b):
        assert await stored(bus, subjects.INCIDENTS, subjects.incident(job)) == 1, job
        assert await stored(bus, subjects.COMMANDS, subjects.cmd(job)) == 1, job


async def test_a_killed_guardians_job_is_judged_by_the_other_exactly_once(
    db: str, nats_url: str, bus: Bus, guardians: list[ServiceProcess], tmp_path: Path
) -> None:
    first = start_guardian(db, nats_url, tmp_path, "first")
    guardians.append(first)
    await eventually(lambda: _holds(db, first), timeout=60, what="the first guardian holding the lock")
    second = start_guardian(db, nats_url, tmp_path, "second")
    guardians.append(second)

    job_id = "j-ha-" + uuid.uuid4().hex[:8]
    await launch_on(bus, job_id, {0: NODE, 1: NODE})
    for rank in (0, 1):
        started = RankStarted(job_id=job_id, attempt=1, rank=rank, node=NODE, pid=100 + rank, log_path="-")
        await bus.publish(subjects.status(job_id, NODE), started)
    for k in range(6):
        for rank in (0, 1):
            await bus.publish(subjects.step(job_id, NODE), step(job_id, k, rank, 3.0 - 0.01 * k))
    await eventually(lambda: settled(bus), timeout=30, what="the first guardian judging the clean steps")

    async with bus.watch(subjects.incident(job_id)) as incidents:
        first.kill()
        killed = time.monotonic()
        await bus.publish(subjects.step(job_id, NODE), step(job_id, 6, 0, 2.9))
        await bus.publish(subjects.step(job_id, NODE), step(job_id, 6, 1, math.nan))
        incident = await incidents.next(TAKEOVER_S + 30)
        judged_s = time.monotonic() - killed
        assert isinstance(incident, IncidentRaised), incident
        assert (incident.kind, incident.rank, incident.step) == ("nan", 1, 6)
        print(f"guardian hand-over: the NaN judged {judged_s:.2f}s after SIGKILL (takeover {TAKEOVER_S}s)")
        assert judged_s <= TAKEOVER_S + 10
        await eventually(lambda: settled(bus), timeout=30, what="the second guardian judging all")
        assert await lock_holder(db) == second.proc.pid
        info = await bus.js.stream_info(subjects.INCIDENTS.name, subjects_filter=subjects.incident(job_id))
        assert (info.state.subjects or {}).get(subjects.incident(job_id)) == 1  # exactly one incident
        cmds = await bus.js.stream_info(subjects.COMMANDS.name, subjects_filter=subjects.cmd(job_id))
        assert (cmds.state.subjects or {}).get(subjects.cmd(job_id)) == 1  # one rollback


async def _holds(db: str, g: ServiceProcess) -> bool:
    assert g.proc.poll() is None, g.log.read_text()[-3000:]
    return await lock_holder(db) == g.proc.pid
