"""One oversized report must not stop a guardian share. The probe's route: one `StepReplayed` naming
60,000 culprits (120 KB) made an incident over 1 MiB, which JetStream refused; the guardian retried it
forever, and no later fault of that share was judged (the victim's NaN went unseen).

Now the event models bound what a rank reports (culprits unique and at most `MAX_CULPRITS`), so the
same report, published as its node's worker would forward it, is dead-lettered as malformed; and an
incident the bus refuses for good (built here from a report made before the bounds) goes out truncated
instead of being retried. Either way the next fault of another job in the same share is judged in time."""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import AsyncIterator, Awaitable, Callable

import pytest

from tests.helpers import eventually, launch_on
from tests.integration.guardian.test_e2e_ranks import fresh_database
from tests.integration.guardian.test_guardian import judged
from tests.integration.security.test_forged_events import (
    dead_letters,
    guardian_on,
    guardian_running,  # noqa: F401  (a fixture)
    step,
)
from vigil.events import (
    MAX_CULPRITS,
    CheckpointSaved,
    IncidentRaised,
    JobStateChanged,
    RankStarted,
    RollbackJob,
    StepReplayed,
)
from vigil_common import credentials, subjects
from vigil_common.bus import Bus
from vigil_common.db import create_pool, migrate
from vigil_guardian.core import Guardian
from vigil_guardian.notifier import Notifier
from vigil_guardian.service import GuardianService, job_input

pytestmark = [pytest.mark.integration, pytest.mark.security]

JUDGED_WITHIN_S = 10.0  # a NaN step to its rollback command, with one oversized report before it
ON_N2 = {0: "n2", 1: "n2"}


def same_share(job_id: str) -> str:
    """Another job id in `job_id`'s guardian share."""
    share = subjects.share_of(job_id)
    return next(v for i in range(1000) if subjects.share_of(v := f"{job_id}-v{i}") == share)


async def running_with_a_checkpoint(sched: Bus, worker: Bus, job_id: str) -> None:
    await launch_on(sched, job_id, ON_N2)
    for rank in ON_N2:
        started = RankStarted(job_id=job_id, attempt=1, rank=rank, node="n2", pid=100 + rank, log_path="-")
        await worker.publish(subjects.status(job_id, "n2"), started)
    saved = CheckpointSaved(
        job_id=job_id, attempt=1, step=0, path=f"/ckpt/{job_id}/step_00000000", bytes=1,
        manifest_sha256="x", data_position=0,
    )  # fmt: skip
    await worker.publish(subjects.status(job_id, "n2"), saved)
    for k in range(3):
        for rank in ON_N2:
            await worker.publish(subjects.step(job_id, "n2"), step(job_id, k, rank, "n2", 3.0 - 0.01 * k))


def probe_report(job_id: str) -> StepReplayed:
    """The probe's report: 60,000 culprits (the model refuses to build it: copied in past it)."""
    ok = StepReplayed(
        job_id=job_id, attempt=1, step=2, node="n2", kind="nan", outcome="transient", culprits=[0],
        values=[], data_position=2, held_s=0.1,
    )  # fmt: skip
    return ok.model_copy(update={"culprits": list(range(60_000))})


async def nan_judged_in(admin: Bus, worker: Bus, victim: str) -> float:
    """Seconds from the victim's NaN step to the guardian's rollback command."""
    async with admin.watch(subjects.cmd(victim)) as commands:
        t0 = time.monotonic()
        for rank in ON_N2:
            await worker.publish(subjects.step(victim, "n2"), step(victim, 3, rank, "n2", math.nan))
        while True:
            command = await commands.next(JUDGED_WITHIN_S * 3)
            assert command is not None, "the victim's NaN was never judged"
            if isinstance(command, RollbackJob):
                return time.monotonic() - t0


async def ended(sched: Bus, *job_ids: str) -> None:
    for job_id in job_ids:
        done = JobStateChanged(
            job_id=job_id, attempt=1, from_state="RUNNING", to_state="SUCCEEDED", cause="t"
        )
        await sched.publish(subjects.status(job_id, subjects.CONTROL), done)


@pytest.fixture
async def guardian_alone(server, admin: Bus, database_url: str, tmp_path) -> AsyncIterator[None]:  # type: ignore[no-untyped-def]
    """The guardian service as its own NATS user, on a database of its own: the session's database holds
    every earlier test's jobs, which a guardian restores and checks for hangs at its start, so the NaN
    this test times would wait behind them (it did, in every full run, never in this folder alone)."""
    db = await fresh_database(database_url)
    pool = await create_pool(db)
    try:
        await migrate(pool)
    finally:
        await pool.close()
    async with guardian_on(server, admin, db, tmp_path):
        yield


@pytest.mark.usefixtures("guardian_alone")
async def test_sixty_thousand_culprits_are_dead_lettered_and_the_shares_next_nan_is_judged_in_time(
    connect: Callable[[str], Awaitable[Bus]], admin: Bus, job_id: str
) -> None:
    sched, n2 = await connect(credentials.SCHEDULER), await connect(credentials.worker_role("n2"))
    attacker, victim = job_id, same_share(job_id)
    await running_with_a_checkpoint(sched, n2, attacker)
    await running_with_a_checkpoint(sched, n2, victim)
    await eventually(lambda: judged(admin, victim), what="the victim's first steps judged")
    async with admin.watch(subjects.dead_letter(subjects.JOBS.name)) as letters:
        # as the worker forwards a rank's report: on its node's status subject
        await n2.publish(subjects.status(attacker, "n2"), probe_report(attacker))
        took = await nan_judged_in(admin, n2, victim)
        (letter,) = await dead_letters(letters, job_input(attacker).durable, 1)
    assert f"at most {MAX_CULPRITS} items" in letter.reason and "culprits" in letter.reason, letter.reason
    assert took < JUDGED_WITHIN_S, f"the victim's NaN was judged after {took:.1f}s"
    await ended(sched, attacker, victim)


async def test_an_incident_the_bus_refuses_goes_out_truncated_and_the_share_goes_on(
    server, admin: Bus, migrated: str, job_id: str
) -> None:
    """A report made before the bounds (the model is bypassed) gives an incident over 1 MiB: the stream
    refuses it for good, and the guardian publishes it truncated instead of retrying it forever."""
    bus = await Bus.connect(server.url_for(credentials.GUARDIAN), "test-guardian")
    pool = await create_pool(migrated)
    attacker, victim = job_id, same_share(job_id)
    share = subjects.share_of(attacker)
    service = GuardianService(Guardian(), bus, pool, Notifier([]), share=share, publish_timeout_s=5.0)
    try:
        for job in (attacker, victim):
            await service.handle(await _launch(admin, job))
            saved = CheckpointSaved(
                job_id=job, attempt=1, step=0, path=f"/ckpt/{job}/step_00000000", bytes=1,
                manifest_sha256="x", data_position=0,
            )  # fmt: skip
            await service.handle(saved)
        oversized = probe_report(attacker)
        async with admin.watch(subjects.incident(attacker)) as incidents:
            await asyncio.wait_for(service.handle(oversized), 30)
            incident = await incidents.next(10)
        assert isinstance(incident, IncidentRaised)
        assert incident.evidence["truncated"] is True and incident.evidence["original_bytes"] > 1024 * 1024
        assert len(incident.to_bytes()) < 64 * 1024
        async with admin.watch(subjects.cmd(victim)) as commands:
            t0 = time.monotonic()
            for rank in ON_N2:
                await service.handle(step(victim, 3, rank, "n2", math.nan))
            got = [await commands.next(10), await commands.next(10)]
            took = time.monotonic() - t0
        assert any(isinstance(c, RollbackJob) for c in got), got
        assert took < JUDGED_WITHIN_S
    finally:
        await pool.close()
        await bus.close()


async def _launch(admin: Bus, job_id: str):  # type: ignore[no-untyped-def]
    return await launch_on(admin, job_id, ON_N2)
