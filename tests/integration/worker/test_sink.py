"""The rank's bus sink: publishing never blocks the training loop; commands arrive in stream order."""

from __future__ import annotations

import asyncio
import time

import pytest

from vigil_common import events as ev
from vigil_common import subjects
from vigil_worker.trainer.telemetry import BusSink

pytestmark = pytest.mark.integration


def step_event(job_id: str, step: int) -> ev.StepCompleted:
    return ev.StepCompleted(
        job_id=job_id, attempt=1, rank=0, node="n", step=step, loss=1.0, lr=0.1, tokens=1, tokens_per_s=1.0,
        step_time_s=0.1, local_finite=True,
    )  # fmt: skip


async def test_events_are_published_and_a_full_queue_drops_instead_of_blocking(bus, nats_url, job_id):
    sink = await asyncio.to_thread(BusSink(nats_url, job_id, "test-sink", queue_size=8).start)
    async with bus.watch(subjects.step(job_id)) as stream:
        t0 = time.perf_counter()
        for step in range(2000):
            sink.emit(subjects.step(job_id), step_event(job_id, step))
        emit_s = time.perf_counter() - t0
        t1 = time.perf_counter()
        await asyncio.to_thread(sink.close)
        close_s = time.perf_counter() - t1
        delivered = 2000 - sink.dropped - sink.failed
        got = [await asyncio.wait_for(anext(stream), 10) for _ in range(delivered)]
    assert emit_s < 0.5, f"2000 emits took {emit_s:.3f}s: emit must not wait for the bus"
    assert sink.dropped > 0 and sink.failed == 0
    assert close_s < 5, "close publishes what is queued and stops, even after the queue was full"
    assert [e.step for e in got] == sorted(e.step for e in got)  # in order, gaps where dropped


async def test_commands_arrive_in_order_with_sequence_numbers(bus, nats_url, job_id):
    before = ev.HaltJob(job_id=job_id, attempt=1, reason="sent before the rank started")
    await bus.publish(subjects.cmd(job_id), before)
    sink = await asyncio.to_thread(BusSink(nats_url, job_id, "test-cmds").start)
    try:
        after = ev.ResumeJob(job_id=job_id, attempt=1)
        await bus.publish(subjects.cmd(job_id), after)
        first = await asyncio.to_thread(sink.command, 1, 10.0)
        second = await asyncio.to_thread(sink.command, 2, 10.0)
        assert (first.event_id, second.event_id) == (before.event_id, after.event_id)
        assert sink.latest_seq == 2 and sink.arrival(2) >= sink.arrival(1)
        with pytest.raises(TimeoutError):
            sink.command(3, 0.05)
    finally:
        await asyncio.to_thread(sink.close)
