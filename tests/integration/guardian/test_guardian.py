"""The guardian end to end on real NATS and Postgres, fed synthetic step streams on the bus."""

from __future__ import annotations

import asyncio
import math
from collections.abc import AsyncIterator

import pytest

from tests.helpers import NEVER_HUNG, eventually, service, step_completed, stored
from vigil.events import (
    CheckpointSaved,
    GpuSampled,
    JobStateChanged,
    LaunchJob,
    Message,
    RankPlacement,
    RankStarted,
)
from vigil.spec import JobSpec
from vigil_common import subjects
from vigil_common.bus import Bus
from vigil_common.settings import Settings
from vigil_guardian.main import run
from vigil_guardian.service import INPUTS, job_input, last_stored

pytestmark = pytest.mark.integration


def cfg(nats_url: str, database_url: str, tmp_path) -> Settings:
    return Settings.load(nats_url=nats_url, database_url=database_url, data_dir=tmp_path, metrics_port=0)


class Job:
    """A synthetic job: its launch, checkpoints and ranks' steps, published on the bus."""

    def __init__(self, bus: Bus, job_id: str, world: int = 2, **guardian: object) -> None:
        """`guardian`: the job's guardian settings, over `NEVER_HUNG` (a test that wants a hang sets its own)."""
        self.bus, self.id, self.world = bus, job_id, world
        self.spec = JobSpec(
            name="synthetic", resources={"nodes": world, "gpus_per_node": 1}, guardian=NEVER_HUNG | guardian
        )

    async def launch(self) -> None:
        await self.bus.publish(
            subjects.launch(self.id),
            LaunchJob(
                job_id=self.id,
                attempt=1,
                spec=self.spec,
                master_addr="127.0.0.1",
                master_port=29500,
                placement=[
                    RankPlacement(rank=r, node=f"node{r}", device=0, local_rank=0) for r in range(self.world)
                ],
            ),
        )
        for r in range(self.world):
            await self.bus.publish(
                subjects.status(self.id, f"node{r}"),
                RankStarted(
                    job_id=self.id, attempt=1, rank=r, node=f"node{r}", pid=100 + r, log_path="/dev/null"
                ),
            )

    async def checkpoint(self, step: int) -> None:
        await self.bus.publish(
            subjects.status(self.id, "node0"),  # rank 0 reports a checkpoint
            CheckpointSaved(
                job_id=self.id,
                attempt=1,
                step=step,
                path=f"/ckpt/{self.id}/step_{step:08d}",
                bytes=1,
                manifest_sha256="x",
                data_position=step,
            ),
        )

    async def step(self, k: int, rank: int, loss: float | None = None, **kw: object) -> None:
        loss = 3.0 - 0.01 * k + 0.02 * ((k * 7 + rank) % 5 - 2) if loss is None else loss
        node = f"node{rank}"
        await self.bus.publish(
            subjects.step(self.id, node), step_completed(self.id, k, rank, loss=loss, node=node, **kw)
        )

    async def steps(self, first: int, last: int) -> None:
        for k in range(first, last):
            for r in range(self.world):
                await self.step(k, r)

    async def end(self) -> None:
        await self.bus.publish(
            subjects.status(self.id, subjects.CONTROL),
            JobStateChanged(
                job_id=self.id, attempt=1, from_state="RUNNING", to_state="SUCCEEDED", cause="test over"
            ),
        )


async def take(events: AsyncIterator[Message], n: int, timeout: float = 15.0) -> list[Message]:
    out = []
    for _ in range(n):
        out.append(await asyncio.wait_for(anext(events), timeout))
    return out


async def ready(bus: Bus) -> bool:
    """A guardian consumes every share (its consumers are bound: events published from now on reach it;
    GPU samples are heard from before the first share is judged)."""
    for spec in INPUTS:
        try:
            info = await bus.js.consumer_info(spec.stream.name, spec.durable)
        except Exception:
            return False
        if not info.push_bound:
            return False
    return True


async def judged(bus: Bus, job_id: str) -> bool:
    """The guardian has acknowledged the last event VIGIL_JOBS stored of the job (its share's input)."""
    seq = await last_stored(bus, job_id)
    if seq is None:
        return False
    spec = job_input(job_id)
    info = await bus.js.consumer_info(spec.stream.name, spec.durable)
    return (info.ack_floor.stream_seq if info.ack_floor else 0) >= seq


@pytest.fixture
async def guardian(bus, nats_url, migrated, tmp_path):
    async with service(run, cfg(nats_url, migrated, tmp_path)) as (task, _):
        await eventually(lambda: ready(bus), what="the guardian's consumers")
        yield task


async def test_nan_halts_and_rolls_back_to_the_newest_checkpoint_at_or_before_it(bus, pool, guardian, job_id):
    job = Job(bus, job_id)
    await job.launch()
    await job.checkpoint(0)
    await job.steps(0, 5)
    await job.checkpoint(5)
    await job.steps(5, 7)
    async with bus.watch(subjects.cmd(job_id), subjects.incident(job_id)) as events:
        await job.step(7, 1, math.nan, skipped=True)
        await job.step(7, 0, math.nan, skipped=True)
        halt, rollback, incident = await take(events, 3)
    assert (halt.type, rollback.type, incident.type) == ("job.halt", "job.rollback", "incident.raised")
    assert (
        rollback.checkpoint == f"/ckpt/{job_id}/step_00000005"
        and rollback.step == 5
        and rollback.type == "job.rollback"
    )
    assert (incident.kind, incident.action, incident.step, incident.rank) == ("nan", "rollback", 7, 1)
    assert halt.incident_id == rollback.incident_id == incident.event_id and rollback.attempt == 1
    await eventually(lambda: pool.fetchval("SELECT kind FROM guardian_incidents WHERE job_id = $1", job_id))
    await job.end()


async def test_spike_rolls_back_with_its_data_window_skipped(bus, guardian, job_id):
    job = Job(bus, job_id, spike_skip_steps=3)
    await job.launch()
    await job.checkpoint(0)
    await job.steps(0, 20)
    await job.checkpoint(20)
    await job.steps(20, 25)
    async with bus.watch(subjects.cmd(job_id)) as events:
        await job.step(25, 0, loss=80.0, data_position=31)
        _halt, rollback = await take(events, 2)
    assert rollback.step == 20 and rollback.skip_data == (31, 34)
    assert "spike" in rollback.reason
    await job.end()


async def test_slow_rank_gives_an_imbalance_incident_naming_it(bus, guardian, job_id):
    job = Job(bus, job_id, world=3, imbalance_steps=3)
    await job.launch()
    async with bus.watch(subjects.incident(job_id)) as events:
        for k in range(6):
            for r in range(3):  # rank 1 computes 0.3 s longer; the others wait for it in the all-reduce
                await job.step(k, r, step_time_s=0.5, comm_time_s=0.05 if r == 1 else 0.35)
        (incident,) = await take(events, 1)
    assert (incident.kind, incident.rank, incident.node, incident.action) == (
        "imbalance",
        1,
        "node1",
        "alert",
    )
    assert incident.step == 3 and len(incident.evidence["ratios"]) == 3  # step 0 times start-ups: not judged
    await job.end()


async def test_missing_steps_give_a_hang_incident_then_the_policys_action(bus, guardian, job_id):
    job = Job(bus, job_id, hang_timeout_s=1.0)
    await job.launch()
    await job.checkpoint(0)
    await job.steps(0, 3)
    async with bus.watch(subjects.cmd(job_id), subjects.incident(job_id)) as events:
        await job.step(3, 0)  # rank 1 never reports step 3
        got = await take(events, 3)
    # two subjects: the incident may come before or after the restart, but the ask precedes the restart
    # on the command subject (one subject keeps its order)
    commands = [m for m in got if m.type != "incident.raised"]
    (incident,) = [m for m in got if m.type == "incident.raised"]
    ask, restart = commands
    assert (ask.type, restart.type) == ("job.dump_stacks", "job.restart"), [m.type for m in got]
    assert (incident.kind, incident.rank, incident.action, incident.step) == ("hang", 1, "restart", 3)
    assert incident.evidence["silent_s"] > 1.0
    # the stacks were asked for first; no worker runs these ranks, so the action waited for them at most
    # its bound (VIGIL_HANG_STACKS_S, 2 s), and the incident says none came
    assert ask.type == "job.dump_stacks" and ask.event_id == f"{incident.event_id}-stacks"
    waited = (restart.occurred_at - ask.occurred_at).total_seconds()
    assert ask.within_s <= waited <= ask.within_s + 5.0, (
        waited
    )  # its bound, not more (wide: a loaded machine)
    assert incident.message.endswith("; no stacks: no dump came within 2.0s"), incident.message
    assert (
        restart.type == "job.restart"
        and restart.event_id == f"{incident.event_id}-restart"
        and restart.step == 0
        and restart.checkpoint.endswith("step_00000000")
    )
    await job.end()


async def test_a_guardian_restart_mid_run_misses_nothing(bus, pool, nats_url, migrated, tmp_path, job_id):
    job = Job(bus, job_id, spike_warmup=10, spike_skip_steps=1)
    async with service(run, cfg(nats_url, migrated, tmp_path)) as (task, _):
        await eventually(lambda: ready(bus), what="the guardian's consumers")
        await job.launch()
        await job.checkpoint(0)
        await job.steps(0, 10)
        await job.checkpoint(10)
        await job.steps(10, 15)
        saved = f"SELECT state->'checkpoints' ? '10' FROM guardian_jobs WHERE job_id = '{job_id}'"
        await eventually(lambda: pool.fetchval(saved), what="the checkpoint in the saved state")
        await eventually(lambda: judged(bus, job_id), what="steps judged")
        task.cancel()  # killed, not stopped
        with pytest.raises(asyncio.CancelledError):
            await task
    # while the guardian is down the run goes on, and a spike comes
    await job.steps(15, 18)
    await job.step(18, 1, loss=90.0, data_position=18)
    async with (
        bus.watch(subjects.cmd(job_id), subjects.incident(job_id)) as events,
        service(run, cfg(nats_url, migrated, tmp_path)),
    ):
        _halt, rollback, incident = await take(events, 3, timeout=30)
        await eventually(lambda: judged(bus, job_id), what="the restarted guardian caught up")
    # judged once, by the stream (a decision is published before its cause is acknowledged): one incident,
    # and its halt and rollback, whatever came late
    assert await stored(bus, subjects.INCIDENTS, subjects.incident(job_id)) == 1
    assert await stored(bus, subjects.COMMANDS, subjects.cmd(job_id)) == 2
    assert (incident.kind, incident.step, incident.rank) == ("spike", 18, 1)
    # a spike needs the warm-up window: it was rebuilt from the steps judged before the kill
    assert incident.evidence["window"] >= 10
    assert rollback.step == 10 and rollback.skip_data == (18, 19)
    await job.end()


async def test_a_sick_device_is_judged_once_for_the_job_on_it_and_an_idle_one_for_its_node(
    bus, guardian, job_id
):
    """The guardian (holding every share) judges each GPU sample once and hands the verdict to the share of
    the job on the device; a device that runs no job is share 0's."""
    tag = job_id[-8:]
    busy, idle = f"gpu-{tag}", f"idle-{tag}"
    await bus.publish(
        subjects.launch(job_id),
        LaunchJob(
            job_id=job_id,
            attempt=1,
            spec=JobSpec(name="synthetic", resources={"nodes": 1, "gpus_per_node": 2}, guardian=NEVER_HUNG),
            master_addr="127.0.0.1",
            master_port=29500,
            placement=[RankPlacement(rank=r, node=busy, device=r, local_rank=r) for r in (0, 1)],
        ),
    )
    await eventually(lambda: judged(bus, job_id), what="the launch judged")

    def hot(node: str, index: int = 0) -> GpuSampled:
        return GpuSampled(
            node=node, index=index, device_kind="gpu", uuid=f"GPU-{node}-{index}", temperature_c=95.0
        )

    async with bus.watch(subjects.incident(job_id), subjects.node_incident(idle)) as events:
        await bus.publish(subjects.gpu(busy), hot(busy))
        (incident,) = await take(events, 1)
        assert (incident.kind, incident.job_id, incident.rank, incident.node) == (
            "gpu_health",
            job_id,
            0,
            busy,
        )
        await bus.publish(subjects.gpu(idle), hot(idle))
        (incident,) = await take(events, 1)
        assert (incident.kind, incident.job_id, incident.node, incident.device) == (
            "gpu_health",
            None,
            idle,
            0,
        )
        await bus.publish(subjects.gpu(busy), hot(busy))  # still sick: no verdict again
        # a marker after it, judged by the same share in order: once its incident is out, so would be a
        # second one of device 0 (absence by the stream, not by a silence)
        await bus.publish(subjects.gpu(busy), hot(busy, 1))
        (marker,) = await take(events, 1)
        assert (marker.job_id, marker.device, marker.rank) == (job_id, 1, 1)
    assert await stored(bus, subjects.INCIDENTS, subjects.incident(job_id)) == 2  # device 0 once, the marker
