"""A worker speaks only for the ranks it launched. The probe's routes: a forged `StepCompleted` with a
NaN loss made the guardian roll another job back (four of them FAILED it), and a forged
`RankExited(exit_code=0)` marked a running job SUCCEEDED. A worker may publish only on its own node's
subjects (test_worker_subjects.py); here worker n1 publishes there about a job whose ranks run on n2,
and the real guardian and scheduler, each with its own NATS user, refuse it (`Origins.admit`): the
event is dead-lettered as forged and the job is untouched."""

from __future__ import annotations

import asyncio
import contextlib
import math
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path

import httpx
import nats.js.errors
import pytest

from tests.helpers import eventually, launch_on, service, step_completed
from tests.integration.guardian.test_guardian import judged
from tests.integration.scheduler.conftest import (
    TOKEN,
    FakeNode,
    exit_rank,
    fresh_database,
    launched,
    scheduler_settings,
    spec,
    start_ranks,
    wait_ready,
    wait_state,
)
from vigil.events import (
    CheckpointSaved,
    JobStateChanged,
    MessageDeadLettered,
    RankExited,
    RankStarted,
    StepCompleted,
)
from vigil_common import credentials, subjects
from vigil_common.bus import Bus, EventStream
from vigil_common.embedded import EmbeddedNats
from vigil_common.settings import Settings
from vigil_guardian import main as guardian
from vigil_guardian import service as guardian_service
from vigil_scheduler import main as scheduler

pytestmark = [pytest.mark.integration, pytest.mark.security]

ON_N2 = {0: "n2", 1: "n2"}  # the job's ranks: both on node n2


def step(job_id: str, k: int, rank: int, node: str, loss: float) -> StepCompleted:
    return step_completed(job_id, k, rank, loss=loss, node=node)


async def dead_letters(letters: EventStream, consumer: str, n: int) -> list[MessageDeadLettered]:
    """The next `n` dead letters of `consumer` (others' are passed over)."""
    out: list[MessageDeadLettered] = []
    while len(out) < n:
        letter = await letters.next(15)
        assert letter is not None, f"{consumer}: {len(out)} of {n} dead letters came"
        if isinstance(letter, MessageDeadLettered) and letter.consumer == consumer:
            out.append(letter)
    return out


async def stored(admin: Bus, stream: subjects.StreamSpec, subject: str) -> bool:
    return await admin.last_stored(stream.name, subject) is not None  # in the form the stream stores


@pytest.fixture
async def guardian_running(
    server: EmbeddedNats, admin: Bus, migrated: str, tmp_path: Path
) -> AsyncIterator[None]:
    """The guardian service as its own NATS user, with a fresh durable consumer."""
    async with guardian_on(server, admin, migrated, tmp_path):
        yield


@contextlib.asynccontextmanager
async def guardian_on(
    server: EmbeddedNats, admin: Bus, database_url: str, tmp_path: Path
) -> AsyncIterator[None]:
    """The guardian service as its own NATS user on `database_url`, with a fresh durable consumer."""
    for made in guardian_service.INPUTS:
        with contextlib.suppress(nats.js.errors.NotFoundError):
            await admin.js.delete_consumer(made.stream.name, made.durable)
    settings = Settings.load(
        nats_url=server.url_for(credentials.GUARDIAN),
        database_url=database_url,
        data_dir=tmp_path,
        metrics_port=0,
    )
    async with service(guardian.run, settings):
        for made in guardian_service.INPUTS:
            await eventually(lambda made=made: _consumer(admin, made), what="the guardian's consumers")
        yield


async def _consumer(admin: Bus, spec):  # type: ignore[no-untyped-def]
    try:
        return await admin.js.consumer_info(spec.stream.name, spec.durable)
    except nats.js.errors.NotFoundError:
        return None


async def test_a_forged_nan_step_from_another_node_is_dead_lettered_and_the_job_left_alone(
    connect: Callable[[str], Awaitable[Bus]], admin: Bus, guardian_running: None, job_id: str
) -> None:
    sched, n1, n2 = (
        await connect(credentials.SCHEDULER),
        await connect(credentials.worker_role("n1")),
        await connect(credentials.worker_role("n2")),
    )
    await launch_on(sched, job_id, ON_N2)
    for rank, node in ON_N2.items():
        started = RankStarted(job_id=job_id, attempt=1, rank=rank, node=node, pid=100 + rank, log_path="-")
        await n2.publish(subjects.status(job_id, node), started)
    checkpoint = CheckpointSaved(
        job_id=job_id,
        attempt=1,
        step=0,
        path=f"/ckpt/{job_id}/step_00000000",
        bytes=1,
        manifest_sha256="x",
        data_position=0,
    )
    await n2.publish(subjects.status(job_id, "n2"), checkpoint)
    for k in range(3):
        for rank in ON_N2:
            await n2.publish(subjects.step(job_id, "n2"), step(job_id, k, rank, "n2", 3.0 - 0.01 * k))
    async with admin.watch(subjects.dead_letter(subjects.JOBS.name)) as letters:
        # on its own node's subject (the only one its user may use), as itself and posing as n2
        await n1.publish(subjects.step(job_id, "n1"), step(job_id, 3, 0, "n1", math.nan))
        await n1.publish(subjects.step(job_id, "n1"), step(job_id, 3, 1, "n2", math.nan))
        refused = await dead_letters(letters, guardian_service.job_input(job_id).durable, 2)
    assert all(d.subject == subjects.step(job_id, "n1") and "forged" in d.reason for d in refused), refused
    for rank in ON_N2:  # the run goes on, and its next steps are judged
        await n2.publish(subjects.step(job_id, "n2"), step(job_id, 3, rank, "n2", 2.9))
    await eventually(lambda: judged(admin, job_id), what="every event judged")
    assert not await stored(admin, subjects.COMMANDS, subjects.cmd(job_id))  # no halt, no rollback
    assert not await stored(admin, subjects.INCIDENTS, subjects.incident(job_id))
    ended = JobStateChanged(
        job_id=job_id, attempt=1, from_state="RUNNING", to_state="SUCCEEDED", cause="test"
    )
    await sched.publish(subjects.status(job_id, subjects.CONTROL), ended)


async def test_a_forged_clean_exit_from_another_node_is_dead_lettered_and_the_job_keeps_running(
    server: EmbeddedNats,
    connect: Callable[[str], Awaitable[Bus]],
    admin: Bus,
    database_url: str,
    tmp_path: Path,
) -> None:
    settings = scheduler_settings(
        await fresh_database(database_url), server.url_for(credentials.SCHEDULER), tmp_path
    )
    n1, n2 = await connect(credentials.worker_role("n1")), await connect(credentials.worker_role("n2"))
    node = FakeNode(n2, "n2", slots=2)  # the only node with free devices: the job runs on n2
    async with (
        service(scheduler.run, settings) as (task, _),
        httpx.AsyncClient(
            base_url=f"http://{settings.http_host}:{settings.http_port}",
            headers={"Authorization": f"Bearer {TOKEN}"},
        ) as http,
    ):
        await wait_ready(str(http.base_url), task=task)
        node.start()
        try:
            job_id = (await http.post("/api/v1/jobs", json=spec(nodes=1, per_node=2))).json()["id"]
            launch = await launched(admin, job_id)
            assert {p.node for p in launch.placement} == {"n2"}
            await start_ranks(n2, launch)
            await wait_state(admin, job_id, "RUNNING")
            async with admin.watch(subjects.dead_letter(subjects.JOBS.name)) as letters:
                for p in launch.placement:  # every rank "exits 0", said by n1 on its own subject
                    exited = RankExited(
                        job_id=job_id, attempt=1, rank=p.rank, node="n1", exit_code=0, failure="ok"
                    )
                    await n1.publish(subjects.status(job_id, "n1"), exited)
                refused = await dead_letters(letters, scheduler.STATUS.durable, 2)
            assert all("forged" in d.reason for d in refused), refused
            assert (await http.get(f"/api/v1/jobs/{job_id}")).json()["state"] == "RUNNING"
            # the node that runs the job cannot name a checkpoint outside the job's own folder either
            # (the probe's forged CheckpointSaved for any path was stored and listed)
            async with admin.watch(subjects.dead_letter(subjects.JOBS.name)) as letters:
                for path in ("/etc", f"/data/checkpoints/not-{job_id}/step_00000005"):
                    forged = CheckpointSaved(
                        job_id=job_id, attempt=1, step=5, path=path, bytes=1, manifest_sha256="x",
                        data_position=5,
                    )  # fmt: skip
                    await n2.publish(subjects.status(job_id, "n2"), forged)
                refused = await dead_letters(letters, scheduler.STATUS.durable, 2)
            assert all(f"is not <checkpoints>/{job_id}/step_00000005" in d.reason for d in refused), refused
            # the genuine exits, from n2, end it
            for p in launch.placement:
                await exit_rank(n2, launch, p.rank, 0)
            await wait_state(admin, job_id, "SUCCEEDED")
        finally:
            await asyncio.wait_for(node.stop(), 10)
