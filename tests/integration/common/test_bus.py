"""The bus client against a real NATS JetStream server."""

from __future__ import annotations

import asyncio
import contextlib
import uuid

import nats.js.errors
import pytest

from vigil import events as ev
from vigil.errors import RetryableError
from vigil_common import subjects
from vigil_common.bus import Bus, ConsumerSpec, Delivery

pytestmark = pytest.mark.integration


def cmd_spec(job_id: str, **kw) -> ConsumerSpec:
    return ConsumerSpec(
        stream=subjects.COMMANDS,
        durable=f"t-{uuid.uuid4().hex[:8]}",
        filter_subject=subjects.cmd(job_id),
        **kw,
    )


async def run_until(
    bus: Bus, spec: ConsumerSpec, handler, done: asyncio.Event, timeout: float = 20.0
) -> None:
    """Run a consumer until `done` is set (or fail after `timeout`)."""
    stop = asyncio.Event()
    task = asyncio.create_task(bus.consume(spec, handler, stop))
    try:
        await asyncio.wait_for(done.wait(), timeout)
    finally:
        stop.set()
        await asyncio.wait_for(task, 10)


async def settled(bus: Bus, spec: ConsumerSpec, timeout: float = 10.0):
    """Consumer info once no message is pending or awaiting its ack (acks are sent asynchronously)."""
    deadline = asyncio.get_running_loop().time() + timeout
    while True:
        info = await bus.js.consumer_info(spec.stream.name, spec.durable)
        if (
            info.num_pending == 0 and info.num_ack_pending == 0
        ) or asyncio.get_running_loop().time() > deadline:
            return info
        await asyncio.sleep(0.05)  # polling the server's view, bounded by the deadline


async def stream_count(bus: Bus, subject: str) -> int:
    subject = subjects.stored(subject)  # as its stream stores it
    info = await bus.js.stream_info(subjects.stream_for(subject).name, subjects_filter=subject)
    return (info.state.subjects or {}).get(subject, 0)


async def test_publishing_the_same_event_twice_stores_one_message(bus: Bus, job_id: str):
    event = ev.CancelJob(job_id=job_id, attempt=1, reason="twice")
    first = await bus.publish(subjects.cmd(job_id), event)
    second = await bus.publish(subjects.cmd(job_id), event)
    assert not first.duplicate and second.duplicate
    assert first.seq == second.seq
    assert await stream_count(bus, subjects.cmd(job_id)) == 1


async def test_ack_happens_only_after_the_effect(bus: Bus, job_id: str):
    spec = cmd_spec(job_id)
    entered, release, done = asyncio.Event(), asyncio.Event(), asyncio.Event()
    seen: list[ev.Message] = []

    async def handler(event: ev.Message, delivery: Delivery) -> None:
        entered.set()
        await release.wait()
        seen.append(event)
        done.set()

    await bus.publish(subjects.cmd(job_id), ev.HaltJob(job_id=job_id, attempt=1, reason="r"))
    stop = asyncio.Event()
    task = asyncio.create_task(bus.consume(spec, handler, stop))
    await asyncio.wait_for(entered.wait(), 10)
    info = await bus.js.consumer_info(spec.stream.name, spec.durable)
    assert info.num_ack_pending == 1  # delivered, effect not done: not acked
    release.set()
    await asyncio.wait_for(done.wait(), 10)
    info = await settled(bus, spec)
    stop.set()
    await asyncio.wait_for(task, 10)
    assert info.num_ack_pending == 0 and len(seen) == 1


async def test_a_consumer_that_dies_before_acking_gets_the_message_again(bus: Bus, job_id: str):
    spec = cmd_spec(job_id, ack_wait_s=1.0)
    await bus.publish(subjects.cmd(job_id), ev.CancelJob(job_id=job_id, attempt=1, reason="die"))
    entered, released = asyncio.Event(), asyncio.Event()

    async def dies(event: ev.Message, delivery: Delivery) -> None:
        entered.set()
        await released.wait()  # does not finish while the test runs: the consumer is killed mid-effect

    stop = asyncio.Event()
    task = asyncio.create_task(bus.consume(spec, dies, stop))
    await asyncio.wait_for(entered.wait(), 10)
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task

    got: list[int] = []
    done = asyncio.Event()

    async def survives(event: ev.Message, delivery: Delivery) -> None:
        got.append(delivery.num_delivered)
        done.set()

    await run_until(bus, spec, survives, done)
    assert got == [2]
    released.set()  # the dead consumer's effect ends, or the bus's close waits its 30 s drain for it


async def test_a_transient_failure_is_retried_with_back_off(bus: Bus, job_id: str):
    spec = cmd_spec(job_id, backoff_s=(0.05,))
    await bus.publish(subjects.cmd(job_id), ev.ResumeJob(job_id=job_id, attempt=1))
    attempts: list[int] = []
    done = asyncio.Event()

    async def flaky(event: ev.Message, delivery: Delivery) -> None:
        attempts.append(delivery.num_delivered)
        if delivery.num_delivered == 1:
            raise RetryableError("database busy")
        done.set()

    await run_until(bus, spec, flaky, done)
    assert attempts == [1, 2]


async def test_a_malformed_message_is_recorded_and_the_consumer_goes_on(bus: Bus, job_id: str):
    spec = cmd_spec(job_id)
    subject = subjects.cmd(job_id)
    await bus.js.publish(subject, b"{not json", headers={"Nats-Msg-Id": uuid.uuid4().hex})
    await bus.js.publish(
        subject,
        ev.StepCompleted(
            job_id=job_id,
            rank=0,
            node="n",
            step=0,
            loss=1.0,
            lr=0.1,
            tokens=1,
            tokens_per_s=1,
            step_time_s=1,
            local_finite=True,
        ).to_bytes(),
        headers={"Nats-Msg-Id": uuid.uuid4().hex},
    )  # valid JSON, wrong type for this subject
    good = ev.CancelJob(job_id=job_id, attempt=1, reason="after the bad ones")
    await bus.publish(subject, good)

    handled: list[ev.Message] = []
    done = asyncio.Event()

    async def handler(event: ev.Message, delivery: Delivery) -> None:
        handled.append(event)
        done.set()

    async with bus.watch(subjects.dead_letter(subjects.COMMANDS.name)) as dead:
        await run_until(bus, spec, handler, done)
        letters = [await asyncio.wait_for(anext(dead), 10) for _ in range(2)]
    assert handled == [good]
    assert all(isinstance(d, ev.MessageDeadLettered) and d.consumer == spec.durable for d in letters)
    reasons = " ".join(d.reason for d in letters)
    assert "not JSON" in reasons and "not carried on this subject" in reasons
    info = await settled(bus, spec)
    assert info.num_pending == 0 and info.num_ack_pending == 0  # terminated, never redelivered
    assert info.num_redelivered == 0


async def test_a_handler_that_keeps_failing_is_dead_lettered_not_retried_forever(bus: Bus, job_id: str):
    spec = cmd_spec(job_id, max_deliver=2, backoff_s=(0.05,))
    await bus.publish(subjects.cmd(job_id), ev.CancelJob(job_id=job_id, attempt=1))
    calls: list[int] = []

    async def broken(event: ev.Message, delivery: Delivery) -> None:
        calls.append(delivery.num_delivered)
        raise RuntimeError("bug")

    async with bus.watch(subjects.dead_letter(subjects.COMMANDS.name)) as dead:
        stop = asyncio.Event()
        task = asyncio.create_task(bus.consume(spec, broken, stop))
        letter = await asyncio.wait_for(anext(dead), 20)
        stop.set()
        await asyncio.wait_for(task, 10)
    assert calls == [1, 2]
    assert "RuntimeError: bug" in letter.reason and letter.num_delivered == 2


async def test_batches_are_acked_after_the_handler(bus: Bus, job_id: str):
    spec = cmd_spec(job_id)
    sent = [ev.CancelJob(job_id=job_id, attempt=1, reason=str(i)) for i in range(20)]
    for e in sent:
        await bus.publish(subjects.cmd(job_id), e)
    got: list[ev.Message] = []
    done = asyncio.Event()

    async def handler(batch: list[tuple[ev.Message, Delivery]]) -> None:
        got.extend(e for e, _ in batch)
        if len(got) >= len(sent):
            done.set()

    stop = asyncio.Event()
    task = asyncio.create_task(bus.consume_batches(spec, handler, stop, max_batch=8))
    await asyncio.wait_for(done.wait(), 20)
    stop.set()
    await asyncio.wait_for(task, 10)
    assert [e.event_id for e in got] == [e.event_id for e in sent]


async def test_trace_context_travels_in_headers(bus: Bus, job_id: str):
    from opentelemetry import trace
    from opentelemetry.sdk.trace import TracerProvider

    tracer = TracerProvider().get_tracer("test")
    with tracer.start_as_current_span("submit") as span:
        await bus.publish(subjects.cmd(job_id), ev.CancelJob(job_id=job_id, attempt=1))
        want = span.get_span_context().trace_id
    got: list[int] = []
    done = asyncio.Event()

    async def handler(event: ev.Message, delivery: Delivery) -> None:
        got.append(trace.get_current_span(delivery.trace_context).get_span_context().trace_id)
        done.set()

    await run_until(bus, cmd_spec(job_id), handler, done)
    assert got == [want]


async def test_ensure_streams_is_idempotent(bus: Bus):
    await bus.ensure_streams()
    await bus.ensure_streams()
    info = await bus.js.stream_info(subjects.COMMANDS.name)
    assert str(getattr(info.config.discard, "value", info.config.discard)) == "new"
    assert str(getattr(info.config.storage, "value", info.config.storage)) == "file"
    assert info.config.duplicate_window == subjects.COMMANDS.duplicate_window_s


async def test_a_watch_survives_a_timed_out_wait(bus: Bus, job_id: str):
    async with bus.watch(subjects.cmd(job_id)) as events:
        assert await events.next(0.05) is None
        sent = ev.ResumeJob(job_id=job_id, attempt=1)
        await bus.publish(subjects.cmd(job_id), sent)
        assert await events.next(10) == sent


async def run_batches(bus: Bus, spec: ConsumerSpec, handler, done: asyncio.Event, **kw) -> None:
    stop = asyncio.Event()
    task = asyncio.create_task(bus.consume_batches(spec, handler, stop, **kw))
    try:
        await asyncio.wait_for(done.wait(), 20)
    finally:
        stop.set()
        await asyncio.wait_for(task, 10)


async def test_a_batch_is_acked_only_after_its_handler_returns(bus: Bus, job_id: str):
    spec = cmd_spec(job_id)
    for i in range(5):
        await bus.publish(subjects.cmd(job_id), ev.CancelJob(job_id=job_id, attempt=1, reason=str(i)))
    release, running, done = asyncio.Event(), asyncio.Event(), asyncio.Event()
    seen: list[int] = []

    async def handler(batch: list[tuple[ev.Message, Delivery]]) -> None:
        info = await bus.js.consumer_info(spec.stream.name, spec.durable)
        seen.append(info.num_ack_pending)  # delivered to us and not acknowledged, while we run
        running.set()
        await release.wait()
        done.set()

    stop = asyncio.Event()
    task = asyncio.create_task(bus.consume_batches(spec, handler, stop))
    try:
        await asyncio.wait_for(running.wait(), 10)
        assert seen == [5]
        release.set()
        await asyncio.wait_for(done.wait(), 10)
        info = await settled(bus, spec)
        assert info.num_ack_pending == 0 and info.num_pending == 0
    finally:
        stop.set()
        await asyncio.wait_for(task, 10)


async def test_the_next_batch_is_decoded_while_one_is_handled_and_handled_after_it(bus: Bus, job_id: str):
    """Decoding overlaps the handler (a malformed message of the next batch is dead-lettered while the
    handler of the one before still runs); handlers still run one at a time, in order, each batch acked
    once."""
    spec = cmd_spec(job_id)
    subject = subjects.cmd(job_id)
    sent = [ev.CancelJob(job_id=job_id, attempt=1, reason=str(i)) for i in range(6)]
    for e in sent[:3]:
        await bus.publish(subject, e)
    await bus.js.publish(subject, b"{not json", headers={"Nats-Msg-Id": uuid.uuid4().hex})
    for e in sent[3:]:
        await bus.publish(subject, e)
    got: list[ev.Message] = []
    running = 0
    overlapped: list[bool] = []
    done = asyncio.Event()

    async with bus.watch(subjects.dead_letter(subjects.COMMANDS.name)) as dead:

        async def handler(batch: list[tuple[ev.Message, Delivery]]) -> None:
            nonlocal running
            running += 1
            assert running == 1, "two batches handled at once"
            if not got:  # the first batch: the next one's malformed message is dead-lettered meanwhile
                letter = await asyncio.wait_for(anext(dead), 10)
                overlapped.append(letter.consumer == spec.durable)
            got.extend(e for e, _ in batch)
            running -= 1
            if len(got) >= len(sent):
                done.set()

        # the consumer's own gathering (0.5 s) lets all 7 arrive before the first batch of 3 is taken
        await run_batches(bus, spec, handler, done, max_batch=3, gather_s=0.5)
    assert overlapped == [True]
    assert got == sent
    info = await settled(bus, spec)
    assert info.num_ack_pending == 0 and info.num_pending == 0


async def test_a_failed_batch_is_redelivered_and_a_malformed_message_dead_lettered(bus: Bus, job_id: str):
    spec = cmd_spec(job_id, backoff_s=(0.05,))
    subject = subjects.cmd(job_id)
    sent = [ev.CancelJob(job_id=job_id, attempt=1, reason=str(i)) for i in range(10)]
    for e in sent[:5]:
        await bus.publish(subject, e)
    await bus.js.publish(subject, b"{not json", headers={"Nats-Msg-Id": uuid.uuid4().hex})
    for e in sent[5:]:
        await bus.publish(subject, e)
    calls: list[list[int]] = []
    stored: list[ev.Message] = []
    done = asyncio.Event()

    async def handler(batch: list[tuple[ev.Message, Delivery]]) -> None:
        calls.append([d.num_delivered for _, d in batch])
        if len(calls) == 1:
            raise RetryableError("database away")
        stored.extend(e for e, _ in batch)
        if len(stored) >= len(sent):
            done.set()

    async with bus.watch(subjects.dead_letter(subjects.COMMANDS.name)) as dead:
        await run_batches(bus, spec, handler, done)
        letter = await asyncio.wait_for(anext(dead), 10)
    assert calls[0] == [1] * 10  # the malformed one never reaches the handler
    assert sorted(e.event_id for e in stored) == sorted(e.event_id for e in sent)
    assert all(n == 2 for c in calls[1:] for n in c)  # each came back once, after the failure
    assert "not JSON" in letter.reason and letter.consumer == spec.durable
    info = await settled(bus, spec)
    assert info.num_ack_pending == 0 and info.num_pending == 0


async def test_batches_of_large_messages_arrive_whole(bus: Bus, job_id: str):
    """Frames split across socket reads: the fast parser waits for the rest of each."""
    spec = cmd_spec(job_id)
    sent = [
        ev.CancelJob(job_id=job_id, attempt=1, reason=f"{i}:" + "x" * (30_000 + 997 * i)) for i in range(60)
    ]
    for e in sent:
        await bus.publish(subjects.cmd(job_id), e)
    got: list[ev.Message] = []
    done = asyncio.Event()

    async def handler(batch: list[tuple[ev.Message, Delivery]]) -> None:
        got.extend(e for e, _ in batch)
        if len(got) >= len(sent):
            done.set()

    await run_batches(bus, spec, handler, done, max_batch=16)
    assert got == sent


async def test_a_stopped_batch_consumer_loses_nothing_it_had_not_handled(bus: Bus, job_id: str):
    """What it held is nak'd on the way out; what was still on the wire comes back after the ack wait."""
    spec = cmd_spec(job_id, ack_wait_s=3, backoff_s=(0.05,))
    sent = [ev.CancelJob(job_id=job_id, attempt=1, reason=str(i)) for i in range(30)]
    for e in sent:
        await bus.publish(subjects.cmd(job_id), e)
    first: list[ev.Message] = []
    done = asyncio.Event()

    async def one_batch(batch: list[tuple[ev.Message, Delivery]]) -> None:
        if done.is_set():  # stopping: whatever else arrives must come back to the next consumer
            raise RetryableError("stopping")
        first.extend(e for e, _ in batch)
        done.set()

    await run_batches(bus, spec, one_batch, done, max_batch=4)  # more than 4 were delivered to it
    rest: list[ev.Message] = []
    done2 = asyncio.Event()

    async def the_rest(batch: list[tuple[ev.Message, Delivery]]) -> None:
        rest.extend(e for e, _ in batch)
        if len(first) + len(rest) >= len(sent):
            done2.set()

    await run_batches(bus, spec, the_rest, done2)
    assert sorted(e.event_id for e in first + rest) == sorted(e.event_id for e in sent)


async def test_an_event_id_on_another_subject_suppresses_nothing(bus: Bus, job_id: str):
    """De-duplication is per stream: the id is scoped by the subject (`bus.msg_id`)."""
    event = ev.CancelJob(job_id=job_id, attempt=1, reason="once")
    other = f"{job_id}-other"
    assert not (await bus.publish(subjects.cmd(other), event.model_copy(update={"job_id": other}))).duplicate
    assert not (await bus.publish(subjects.cmd(job_id), event)).duplicate
    assert (await bus.publish(subjects.cmd(job_id), event)).duplicate
    assert await stream_count(bus, subjects.cmd(job_id)) == 1
    assert await stream_count(bus, subjects.cmd(other)) == 1


async def test_a_watch_reads_what_was_stored_in_order_without_a_consumer(bus: Bus, job_id: str):
    before = [ev.CancelJob(job_id=job_id, attempt=1, reason=f"before {i}") for i in range(3)]
    for e in before:
        await bus.publish(subjects.cmd(job_id), e)
    consumers = (await bus.js.stream_info(subjects.COMMANDS.name)).state.consumer_count
    async with (
        bus.watch(subjects.cmd(job_id), from_start=True) as everything,
        bus.watch(subjects.cmd(job_id), subjects.incident(job_id)) as new,
    ):
        # a watch is no JetStream consumer: a role's permissions allow it none but its own
        assert (await bus.js.stream_info(subjects.COMMANDS.name)).state.consumer_count == consumers
        after = [ev.HaltJob(job_id=job_id, attempt=1, reason=f"after {i}") for i in range(3)]
        for e in after:
            await bus.publish(subjects.cmd(job_id), e)
        assert [await everything.next(10) for _ in range(6)] == before + after
        assert [await new.next(10) for _ in range(3)] == after
        assert await new.next(0.2) is None


async def test_a_scan_reads_since_a_time_up_to_a_sequence_and_leaves_no_consumer(bus: Bus, job_id: str):
    name = f"scan-{uuid.uuid4().hex[:8]}"
    sent = [ev.CancelJob(job_id=job_id, attempt=1, reason=str(i)) for i in range(5)]
    acks = [await bus.publish(subjects.cmd(job_id), e) for e in sent]

    async def refuse_two(subject: str, event: ev.Message) -> str | None:
        return "forged" if getattr(event, "reason", "") == "2" else None

    got = [e async for e in bus.scan(name, subjects.cmd(job_id), since=0, upto=acks[3].seq, admit=refuse_two)]
    assert got == [sent[0], sent[1], sent[3]]
    with pytest.raises(nats.js.errors.NotFoundError):
        await bus.js.consumer_info(subjects.COMMANDS.name, name)
