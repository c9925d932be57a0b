"""Least privilege on the bus, against a real nats-server with the roles' `authorization` block: what a
credential may not publish is refused by the server and never stored; ranks act only on commands
delivered from the command stream."""

from __future__ import annotations

import asyncio
import stat
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import nats.js.errors
import pytest
from nats.js.api import AckPolicy, ConsumerConfig

from tests.helpers import eventually
from tests.integration.secured import refused, secured_nats
from tests.unit.common.samples import SAMPLES
from vigil.errors import RetryableError
from vigil.events import HaltJob, IncidentRaised, Message, NodeHeartbeat, StepCompleted
from vigil_common import credentials, subjects
from vigil_common.bus import Bus, ConsumerSpec, Presence
from vigil_common.embedded import EmbeddedNats

pytestmark = pytest.mark.integration


def sample(kind: type[Message], **update: object) -> Message:
    return SAMPLES[kind].model_copy(update={"event_id": uuid.uuid4().hex, **update})


def step_event(job_id: str) -> Message:
    return sample(StepCompleted, job_id=job_id)


@pytest.fixture(scope="module")
def secured(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[EmbeddedNats, Path]]:
    data = tmp_path_factory.mktemp("secured")
    with secured_nats(data, ["n1"]) as server:
        yield server, data


@pytest.fixture
async def admin(secured: tuple[EmbeddedNats, Path]) -> AsyncIterator[Bus]:
    bus = await Bus.connect(secured[0].url, "test-admin")
    await bus.ensure_streams()
    yield bus
    await bus.close()


async def stored(admin: Bus, stream: subjects.StreamSpec, subject: str) -> bool:
    return await admin.last_stored(stream.name, subject) is not None  # in the form the stream stores


def test_credentials_and_server_config_are_0600(secured: tuple[EmbeddedNats, Path]) -> None:
    server, data = secured
    for path in (data / credentials.CREDENTIALS_FILE, server.data_dir / "nats.conf"):
        assert stat.S_IMODE(path.stat().st_mode) == 0o600, path


async def test_no_credential_no_connection(secured: tuple[EmbeddedNats, Path]) -> None:
    with pytest.raises(Exception, match=r"(?i)authorization"):
        await nats.connect(secured[0].bare_url, allow_reconnect=False, max_reconnect_attempts=0)


async def test_a_worker_credential_publishing_a_command_is_refused(
    secured: tuple[EmbeddedNats, Path], admin: Bus, job_id: str
) -> None:
    server, _ = secured
    worker = await Bus.connect(server.url_for(credentials.worker_role("n1")), "test-worker")
    try:
        halt = HaltJob(job_id=job_id, attempt=1, reason="forged by a worker")
        with pytest.raises(RetryableError):
            await worker.publish(subjects.cmd(job_id), halt, timeout_s=1.0)
        # its own node's heartbeat and a step are allowed
        await worker.publish(subjects.heartbeat("n1"), sample(NodeHeartbeat, node="n1"))
        await worker.publish(subjects.step(job_id, "n1"), step_event(job_id))
    finally:
        await worker.close()
    assert not await stored(admin, subjects.COMMANDS, subjects.cmd(job_id))
    assert await stored(admin, subjects.NODES, subjects.heartbeat("n1"))
    assert await stored(admin, subjects.JOBS, subjects.step(job_id, "n1"))


@pytest.mark.parametrize(
    ("role", "subject"),
    [
        (credentials.worker_role("n1"), subjects.heartbeat("n2")),  # another node's events
        (credentials.worker_role("n1"), subjects.launch("j-x")),
        (credentials.worker_role("n1"), subjects.cmd("j-x")),
        (credentials.worker_role("n1"), subjects.incident("j-x")),
        (credentials.TELEMETRY, subjects.step("j-x", "n1")),
        (credentials.TELEMETRY, subjects.cmd("j-x")),
        (credentials.GUARDIAN, subjects.launch("j-x")),
        (credentials.worker_role("n1"), "_INBOX.someone-elses-consumer"),  # no forged deliveries
        (credentials.worker_role("n1"), "$JS.API.STREAM.UPDATE." + subjects.COMMANDS.name),
        (credentials.GUARDIAN, "$JS.API.STREAM.DELETE." + subjects.JOBS.name),
        (credentials.TELEMETRY, "$JS.API.STREAM.PURGE." + subjects.JOBS.name),
    ],
)
async def test_the_server_refuses_what_a_role_may_not_publish(
    secured: tuple[EmbeddedNats, Path], admin: Bus, role: str, subject: str
) -> None:
    refusals = await refused(secured[0], role, lambda nc: nc.publish(subject, b"{}"))
    assert refusals.of("publish", subject), refusals.seen


async def test_the_guardian_and_scheduler_publish_commands(
    secured: tuple[EmbeddedNats, Path], admin: Bus, job_id: str
) -> None:
    for role in (credentials.GUARDIAN, credentials.SCHEDULER):
        bus = await Bus.connect(secured[0].url_for(role), f"test-{role}")
        try:
            await bus.publish(subjects.cmd(job_id), HaltJob(job_id=job_id, attempt=1, reason=role))
        finally:
            await bus.close()
    assert await stored(admin, subjects.COMMANDS, subjects.cmd(job_id))


async def test_telemetry_reads_through_its_own_consumer_and_a_worker_watches_commands(
    secured: tuple[EmbeddedNats, Path], admin: Bus, job_id: str
) -> None:
    reader = await Bus.connect(secured[0].url_for(credentials.TELEMETRY), "test-telemetry")
    worker = await Bus.connect(secured[0].url_for(credentials.worker_role("n1")), "test-worker")
    got: list[StepCompleted] = []
    done, stop = asyncio.Event(), asyncio.Event()

    async def handler(batch):  # type: ignore[no-untyped-def]
        got.extend(e for e, _ in batch)
        done.set()

    spec = ConsumerSpec(
        stream=subjects.JOBS,
        durable="telemetry-steps",  # one of the names its user owns (credentials.consumers)
        filter_subject=subjects.job_steps(job_id),
        deliver_new=True,
    )
    try:
        await reader.ensure_streams(manage=False)
        consumer = asyncio.create_task(reader.consume_batches(spec, handler, stop))
        async with worker.watch(subjects.cmd(job_id), from_start=True) as commands:
            await eventually(lambda: _consumer_exists(admin, spec), what="telemetry's consumer")
            await worker.publish(subjects.step(job_id, "n1"), step_event(job_id))
            await admin.publish(subjects.cmd(job_id), HaltJob(job_id=job_id, attempt=1, reason="real"))
            assert (await commands.next(10)).reason == "real"  # type: ignore[union-attr]
            await asyncio.wait_for(done.wait(), 10)
        stop.set()
        await consumer
    finally:
        await reader.close()
        await worker.close()
    assert [e.job_id for e in got] == [job_id]


async def _consumer_exists(admin: Bus, spec: ConsumerSpec) -> bool:
    try:
        await admin.js.consumer_info(spec.stream.name, spec.durable)
    except nats.js.errors.NotFoundError:
        return False
    return True


async def test_a_watcher_acts_only_on_what_the_command_stream_stored(
    secured: tuple[EmbeddedNats, Path], admin: Bus, job_id: str
) -> None:
    """A worker's command watch is woken by the command subject but reads the stream: a message on that
    subject that the stream did not store (refused here by its expected-sequence header) is not read."""
    worker = await Bus.connect(secured[0].url_for(credentials.worker_role("n1")), "test-worker")
    try:
        async with worker.watch(subjects.cmd(job_id), from_start=True) as commands:
            forged = HaltJob(job_id=job_id, attempt=1, reason="not stored")
            with pytest.raises(nats.js.errors.BadRequestError):  # wrong last sequence: not stored
                await admin.js.publish(
                    subjects.cmd(job_id),
                    forged.to_bytes(),
                    headers={"Nats-Expected-Last-Subject-Sequence": "999999"},
                )
            await admin.publish(subjects.cmd(job_id), HaltJob(job_id=job_id, attempt=1, reason="real"))
            first = await commands.next(10)
            assert first is not None and first.reason == "real"  # type: ignore[attr-defined]
            assert await commands.next(0.5) is None
    finally:
        await worker.close()


async def test_a_consumer_made_with_the_shared_inbox_prefix_is_replaced_on_upgrade(
    secured: tuple[EmbeddedNats, Path], admin: Bus, job_id: str
) -> None:
    """Durables made before each role had its own inbox deliver into `_INBOX.`, which a role may no
    longer read: the service replaces its consumer (from the old one's ack floor) instead of going deaf."""
    spec = ConsumerSpec(
        stream=subjects.INCIDENTS,
        durable="telemetry-incidents",
        filter_subject=subjects.incident(job_id),
        shared=True,
    )
    await admin.js.add_consumer(
        spec.stream.name,
        ConsumerConfig(
            name=spec.durable,
            durable_name=spec.durable,
            deliver_subject="_INBOX.made-by-an-older-vigil",
            deliver_group=spec.durable,
            filter_subject=spec.filter_subject,
            ack_policy=AckPolicy.EXPLICIT,
            max_ack_pending=spec.max_ack_pending,
        ),
    )
    incident = sample(IncidentRaised, job_id=job_id)
    await admin.publish(subjects.incident(job_id), incident)
    telemetry = await Bus.connect(secured[0].url_for(credentials.TELEMETRY), "test-telemetry")
    got: list[Message] = []
    done, stop = asyncio.Event(), asyncio.Event()

    async def handler(batch):  # type: ignore[no-untyped-def]
        got.extend(e for e, _ in batch)
        done.set()

    try:
        consumer = asyncio.create_task(telemetry.consume_batches(spec, handler, stop))
        await asyncio.wait_for(done.wait(), 10)
        stop.set()
        await consumer
    finally:
        await telemetry.close()
    assert got == [incident]
    info = await admin.js.consumer_info(spec.stream.name, spec.durable)
    assert (info.config.deliver_subject or "").startswith("_INBOX_telemetry.")


async def test_a_worker_answers_its_ping_while_connected_and_the_server_says_when_it_is_gone(
    secured: tuple[EmbeddedNats, Path],
) -> None:
    """The scheduler's quick check of a node (`Bus.presence`): answered while the worker is connected,
    "no responders" from the server itself once its connection closed; no other role can answer it."""
    server, _ = secured
    scheduler = await Bus.connect(server.url_for(credentials.SCHEDULER), "test-scheduler")
    worker = await Bus.connect(server.url_for(credentials.worker_role("n1")), "test-worker")
    guardian = await Bus.connect(server.url_for(credentials.GUARDIAN), "test-guardian")
    stop, ready = asyncio.Event(), asyncio.Event()

    async def answered_as(want: Presence) -> Presence | None:
        got = await scheduler.presence(subjects.ping("n1"), timeout_s=2)
        return got if got is want else None

    try:
        assert await scheduler.presence(subjects.ping("n1")) is Presence.GONE  # nobody answers yet
        answering = asyncio.create_task(worker.answer_pings(subjects.ping("n1"), stop, ready))
        await asyncio.wait_for(ready.wait(), 10)
        # Asked until answered, as the scheduler asks twice before it acts on a "gone" (core.PRESENCE_AGAIN_S):
        # a CI run once saw one "no responders" just after the worker's flushed subscription.
        await eventually(lambda: answered_as(Presence.ANSWERED), what="the connected worker's answer")
        await worker.close()  # the connection closes: the server drops the subscription
        stop.set()
        await answering
        stop.clear()
        await eventually(lambda: answered_as(Presence.GONE), what="no responders once it closed")
        # another role may not subscribe to a node's ping (its subscription is refused: still nobody)
        refused_sub = asyncio.Event()
        hijack = asyncio.create_task(guardian.answer_pings(subjects.ping("n1"), stop, refused_sub))
        await asyncio.wait_for(refused_sub.wait(), 10)  # its SUB, then a flush, reached the server
        for _ in range(3):
            assert await scheduler.presence(subjects.ping("n1"), timeout_s=10) is Presence.GONE
        stop.set()
        await asyncio.wait_for(hijack, 10)
    finally:
        stop.set()
        for bus in (scheduler, worker, guardian):
            await bus.close()
