"""The bus's pure parts: the de-duplication id, which consumer delivered a message, the connection's
user (and so its inbox prefix)."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from vigil_common import subjects
from vigil_common.bus import Bus, ConsumerSpec, msg_id, not_delivered_by
from vigil_common.bus.client import _user
from vigil_common.bus.watch import _cancel

JOBS, COMMANDS = subjects.JOBS.name, subjects.COMMANDS.name
V1 = f"$JS.ACK.{JOBS}.guardian.1.42.17.1700000000000000000.3"  # $JS.ACK.<stream>.<consumer>.<5 numbers>
V2 = f"$JS.ACK._.ACCHASH.{JOBS}.guardian.1.42.17.1700000000000000000.3.rand"  # with domain and account


def test_the_dedup_id_is_scoped_by_subject() -> None:
    """JetStream de-duplicates per stream: an event id published on another job's subject must not
    suppress this job's event of that id."""
    assert msg_id(subjects.launch("j-a"), "launch-j-a-1") == "vigil.job.j-a.launch|launch-j-a-1"
    assert msg_id(subjects.step("j-b", "n1"), "launch-j-a-1") != msg_id(
        subjects.launch("j-a"), "launch-j-a-1"
    )
    assert msg_id(subjects.launch("j-a"), "e") == msg_id(subjects.launch("j-a"), "e")


@pytest.mark.parametrize("reply", [V1, V2])
def test_a_delivery_names_its_stream_and_consumer(reply: str) -> None:
    msg = SimpleNamespace(reply=reply)
    assert not_delivered_by(msg, JOBS, "guardian") is None  # type: ignore[arg-type]
    assert not_delivered_by(msg, JOBS) is None  # type: ignore[arg-type]
    assert "consumer 'guardian', not 'replay'" in (not_delivered_by(msg, JOBS, "replay") or "")  # type: ignore[arg-type]
    assert f"stream {JOBS!r}, not {COMMANDS!r}" in (not_delivered_by(msg, COMMANDS) or "")  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "reply",
    [None, "", "_INBOX_guardian.abc", "$JS.ACK.VIGIL_JOBS.guardian", "$JS.ACK.VIGIL_JOBS.guardian.1.2.3"],
)
def test_a_message_without_a_jetstream_ack_subject_was_not_delivered(reply: str | None) -> None:
    why = not_delivered_by(SimpleNamespace(reply=reply), JOBS, "guardian")  # type: ignore[arg-type]
    assert why is not None and "no JetStream ack subject" in why


async def test_a_consumer_drops_what_it_did_not_deliver() -> None:
    spec = ConsumerSpec(stream=subjects.JOBS, durable="guardian", filter_subject=subjects.ALL_JOB_EVENTS)
    bus = object.__new__(Bus)  # _foreign reads only the spec and the message

    async def foreign(subject: str, reply: str | None) -> bool:
        return await bus._foreign(spec, SimpleNamespace(subject=subject, reply=reply))  # type: ignore[arg-type]

    for step in (subjects.step("j1", "n1"), subjects.stored(subjects.step("j1", "n1"))):  # either form
        assert not await foreign(step, V1)
        assert await foreign(step, None)  # pushed into its inbox
        assert await foreign(step, V1.replace(".guardian.", ".replay."))  # replayed through another consumer
        assert await foreign(step, V1.replace(JOBS, COMMANDS))  # from another stream
    assert await foreign(subjects.heartbeat("n1"), V1)  # outside its filter


async def test_a_share_acknowledges_and_skips_an_old_message_of_another_share() -> None:
    """A share's consumer also reads VIGIL_JOBS's messages stored before its transform (every job's)."""
    share = subjects.share_of("j1")
    spec = ConsumerSpec(stream=subjects.JOBS, durable="guardian", filter_subject=subjects.share_events(share))
    bus = object.__new__(Bus)
    acked: list[str] = []

    def message(subject: str) -> SimpleNamespace:
        async def ack() -> None:
            acked.append(subject)

        return SimpleNamespace(subject=subject, reply=V1, ack=ack)

    other = next(j for j in (f"j{k}" for k in range(100)) if subjects.share_of(j) != share)
    assert not await bus._foreign(spec, message(subjects.step("j1", "n1")))  # its own, old form
    assert not await bus._foreign(spec, message(subjects.stored(subjects.step("j1", "n1"))))
    assert await bus._foreign(spec, message(subjects.step(other, "n1")))  # another share's, old form
    assert acked == [subjects.step(other, "n1")]
    assert await bus._foreign(spec, message(subjects.stored(subjects.step(other, "n1"))))  # never delivered
    assert acked == [subjects.step(other, "n1")]  # so not acknowledged either
    bus.legacy_jobs = False  # the old messages are gone: one of them now would be foreign
    assert await bus._foreign(spec, message(subjects.step(other, "n1")))
    assert len(acked) == 1


@pytest.mark.parametrize(
    ("url", "user"),
    [
        ("nats://guardian:secret@127.0.0.1:4222", "guardian"),
        ("nats://worker-n1:p%40ss@nats:4222,nats://worker-n1:p%40ss@nats-2:4222", "worker-n1"),
        ("tls://a%2Fb:pw@nats:4222", "a/b"),
        ("nats://127.0.0.1:4222", None),
        ("nats://s3cr3t-token@127.0.0.1:4222", None),  # a token, not a user: never in a subject
    ],
)
def test_the_user_a_url_logs_in_as(url: str, user: str | None) -> None:
    assert _user(url) == user


async def test_a_watchers_reader_that_drops_a_cancellation_is_cancelled_again() -> None:
    """Python 3.11's wait_for (in every nats-py request) drops a cancellation that comes as its result
    arrives; the watcher's readers must end anyway, or closing the watch hangs."""
    started, dropped = asyncio.Event(), asyncio.Event()

    async def reader() -> None:
        started.set()
        try:
            await asyncio.sleep(30)
        except asyncio.CancelledError:
            dropped.set()  # as if the awaited reply had just arrived: read on
        await asyncio.sleep(30)

    task = asyncio.create_task(reader())
    await started.wait()
    await asyncio.wait_for(_cancel([task]), 5)
    assert dropped.is_set() and task.cancelled()
