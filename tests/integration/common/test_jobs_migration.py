"""A VIGIL_JOBS of the release before the stored form (it stored the published subjects, and the server
copied it by share into VIGIL_SHARES) is migrated in place by `ensure_streams`: the transform is added,
VIGIL_SHARES is deleted, and every reader still sees every event, those stored before in the published
form and those after in the stored form, in one order, until the retention drops the old ones."""

from __future__ import annotations

import asyncio
import uuid

import pytest
from nats.js.api import AckPolicy, ConsumerConfig, StreamConfig, StreamSource, SubjectTransform

from tests.helpers import eventually
from tests.integration.secured import secured_nats
from tests.unit.guardian.helpers import launch, step
from vigil.events import Message, StepCompleted
from vigil_common import credentials, subjects
from vigil_common.bus import Bus, ConsumerSpec, Delivery
from vigil_common.bus.streams import LEGACY_THROUGH
from vigil_common.embedded import EmbeddedNats
from vigil_common.origin import Origins
from vigil_guardian.service import share_input

pytestmark = pytest.mark.integration

OLD_SHARES = "VIGIL_SHARES"
# the previous release's copy: VIGIL_JOBS's subjects by share, in a stream of their own
OLD_COPY = SubjectTransform(
    src="vigil.job.*.>",
    dest=f"vigil.share.{{{{partition({subjects.SHARES},1)}}}}.vigil.job.{{{{wildcard(1)}}}}.>",
)
TELEMETRY_STEPS = ConsumerSpec(
    stream=subjects.JOBS, durable="telemetry-steps", filter_subject=subjects.ALL_STEPS
)
STEPS = 4  # per job: 0 and 1 before the migration, 2 and 3 after


def jobs_in_shares() -> tuple[str, str, str]:
    """Two jobs of one share and one of another."""
    a1 = f"j-{uuid.uuid4().hex[:10]}"
    a2 = b = ""
    while not a2 or not b:
        job = f"j-{uuid.uuid4().hex[:10]}"
        if subjects.share_of(job) == subjects.share_of(a1):
            a2 = a2 or job
        else:
            b = b or job
    return a1, a2, b


async def publish_steps(bus: Bus, jobs: tuple[str, ...], steps: range) -> None:
    for k in steps:
        for job in jobs:
            await bus.publish(subjects.step(job, "n0"), step(k, job_id=job, node="n0"))


async def collect(bus: Bus, spec: ConsumerSpec, n: int) -> list[tuple[Message, Delivery]]:
    """The first `n` events `spec`'s consumer hands its handler."""
    got: list[tuple[Message, Delivery]] = []
    stop = asyncio.Event()

    async def handler(batch: list[tuple[Message, Delivery]]) -> None:
        got.extend(batch)
        if len(got) >= n:
            stop.set()

    await asyncio.wait_for(bus.consume_batches(spec, handler, stop, gather_s=0), timeout=30)
    return got


def steps_of(events: list[Message]) -> list[tuple[str, int]]:
    return [(e.job_id or "", e.step) for e in events if isinstance(e, StepCompleted)]


async def test_an_old_jobs_stream_is_migrated_in_place_and_readers_see_every_event(server_dir) -> None:  # type: ignore[no-untyped-def]
    with EmbeddedNats(server_dir / "nats") as server:
        bus = await Bus.connect(server.url, "test-migration")  # no user: the admin's rights, as `vigil up`
        try:
            # --- the previous release: its streams, its events, a durable consumer of its telemetry ---
            await bus.js.add_stream(
                StreamConfig(name=subjects.JOBS.name, subjects=list(subjects.JOBS.subjects))
            )
            await bus.js.add_stream(
                StreamConfig(
                    name=OLD_SHARES,
                    sources=[StreamSource(name=subjects.JOBS.name, subject_transforms=[OLD_COPY])],
                )
            )
            await bus.js.add_consumer(
                subjects.JOBS.name,
                ConsumerConfig(
                    name=TELEMETRY_STEPS.durable,
                    durable_name=TELEMETRY_STEPS.durable,
                    deliver_subject=bus.nc.new_inbox(),
                    filter_subject=subjects.ALL_STEPS,
                    ack_policy=AckPolicy.EXPLICIT,
                ),
            )
            a1, a2, b = jobs = jobs_in_shares()
            for job in jobs:
                await bus.publish(subjects.launch(job), launch().model_copy(update={"job_id": job}))
            await publish_steps(bus, jobs, range(2))
            old = (await bus.js.stream_info(subjects.JOBS.name)).state.last_seq
            assert old == 3 + 3 * 2

            # --- the migration ---
            await bus.ensure_streams()
            info = await bus.js.stream_info(subjects.JOBS.name)
            assert info.config.subject_transform is not None
            assert (
                info.config.subject_transform.src,
                info.config.subject_transform.dest,
            ) == subjects.JOBS.transform
            assert (info.config.metadata or {}).get(LEGACY_THROUGH) == str(old)
            assert OLD_SHARES not in {i.config.name for i in await bus.js.streams_info()}
            assert bus.legacy_jobs
            await bus.ensure_streams()  # again: the mark stays
            info = await bus.js.stream_info(subjects.JOBS.name)
            assert (info.config.metadata or {}).get(LEGACY_THROUGH) == str(old)

            await publish_steps(bus, jobs, range(2, STEPS))
            for seq in range(1, old + 3 * 2 + 1):  # before: as published; after: under the job's share
                msg = await bus.js.get_msg(subjects.JOBS.name, seq)
                assert msg.subject is not None
                assert (msg.subject == subjects.published(msg.subject)) == (seq <= old), (seq, msg.subject)

            every_step = [(job, k) for k in range(STEPS) for job in jobs]  # in publishing order

            # the durable consumer of the old release goes on from its ack floor, in both forms
            got = await collect(bus, TELEMETRY_STEPS, len(every_step))
            assert steps_of([e for e, _ in got]) == every_step
            consumer = await bus.js.consumer_info(subjects.JOBS.name, TELEMETRY_STEPS.durable)
            assert sorted(consumer.config.filter_subjects or []) == sorted(bus.reads(subjects.ALL_STEPS))

            # a guardian's share: its jobs' events only, in order; another share's old events acknowledged
            share = share_input(subjects.share_of(a1))
            mine = await collect(bus, share, 2 * (1 + STEPS))
            assert {e.job_id for e, _ in mine} == {a1, a2}
            assert steps_of([e for e, _ in mine]) == [(job, k) for job, k in every_step if job != b]
            seqs = [d.stream_seq for _, d in mine]
            assert seqs == sorted(seqs)

            async def idle() -> bool:  # b's old events were acknowledged, not left pending
                state = await bus.consumer_state(share)
                return state is not None and state.idle and state.acked == seqs[-1]

            await eventually(idle, timeout=10, what="the share's consumer acknowledged all it was given")

            # a scan, a watch from the start, and the stored reads (origin checks, a hang's last event)
            scanned = [e async for e in bus.scan("test-scan", subjects.job_steps(b), since=0)]
            assert steps_of(scanned) == [(b, k) for k in range(STEPS)]
            async with bus.watch(subjects.ALL_STEPS, from_start=True) as events:
                watched = [await events.next(timeout=10) for _ in every_step]
            assert steps_of([e for e in watched if e is not None]) == every_step
            first_launch = await bus.next_stored(subjects.JOBS.name, subjects.launch(a2), 1)
            assert first_launch is not None and first_launch.subject == subjects.launch(a2)  # the old form
            last = await bus.last_stored(subjects.JOBS.name, subjects.job_events(a2))
            assert last is not None and last.subject == subjects.stored(subjects.step(a2, "n0"))
            origins = Origins(bus)
            new_step = step(STEPS, job_id=a1, node="n0")
            assert await origins.admit(subjects.step(a1, "n0"), new_step) is None  # its launch is old
            assert await origins.admit(subjects.step(a1, "n9"), new_step.model_copy(update={"node": "n9"}))

            # --- the retention drops the old messages: readers read the stored form only ---
            await bus.js.purge_stream(subjects.JOBS.name, subject=subjects.ALL_JOB_EVENTS)
            later = await Bus.connect(server.url, "test-migration-later")
            try:
                await later.ensure_streams(manage=False)
                assert not later.legacy_jobs
                assert later.reads(subjects.ALL_STEPS) == (subjects.stored(subjects.ALL_STEPS),)
                scanned = [e async for e in later.scan("test-scan", subjects.job_steps(b), since=0)]
                assert steps_of(scanned) == [(b, k) for k in range(2, STEPS)]
            finally:
                await later.close()
        finally:
            await bus.close()


async def test_the_scheduler_stops_the_old_copy_and_leaves_its_deletion_to_the_admin(server_dir) -> None:  # type: ignore[no-untyped-def]
    """No service role may delete a stream: the scheduler (which manages the streams on Compose and
    Kubernetes) migrates VIGIL_JOBS and stops VIGIL_SHARES's copying; the admin credential deletes it."""
    with secured_nats(server_dir, []) as server:
        admin = await Bus.connect(server.url, "test-admin")
        scheduler = await Bus.connect(server.url_for(credentials.SCHEDULER), "test-scheduler")
        try:
            await admin.js.add_stream(
                StreamConfig(name=subjects.JOBS.name, subjects=list(subjects.JOBS.subjects))
            )
            await admin.js.add_stream(
                StreamConfig(
                    name=OLD_SHARES,
                    sources=[StreamSource(name=subjects.JOBS.name, subject_transforms=[OLD_COPY])],
                )
            )
            await admin.publish(subjects.launch("j-old"), launch().model_copy(update={"job_id": "j-old"}))
            await scheduler.ensure_streams()
            jobs = await admin.js.stream_info(subjects.JOBS.name)
            assert jobs.config.subject_transform is not None and scheduler.legacy_jobs
            old = await admin.js.stream_info(OLD_SHARES)
            assert not old.config.sources  # copies nothing, kept for the admin to delete
            await admin.ensure_streams()
            assert OLD_SHARES not in {i.config.name for i in await admin.js.streams_info()}
        finally:
            await scheduler.close()
            await admin.close()
