"""A deployment made when steps had a stream of their own is moved at start, losing no unconsumed step."""

from __future__ import annotations

import pytest
from nats.js.api import AckPolicy, ConsumerConfig, StreamConfig

from tests.unit.guardian.helpers import step
from vigil_common import subjects
from vigil_common.bus import Bus
from vigil_common.embedded import EmbeddedNats

pytestmark = pytest.mark.integration


async def test_steps_not_yet_consumed_are_copied_into_the_jobs_stream_and_the_old_stream_goes(server_dir):
    with EmbeddedNats(server_dir / "nats") as server:
        bus = await Bus.connect(server.url, "test-legacy-steps")
        try:
            js = bus.js
            await js.add_stream(
                StreamConfig(name="VIGIL_JOBS", subjects=[subjects.ALL_LAUNCHES, subjects.ALL_STATUS])
            )
            await js.add_stream(StreamConfig(name=subjects.LEGACY_STEPS, subjects=[subjects.ALL_STEPS]))
            await js.add_consumer(
                "VIGIL_JOBS", ConsumerConfig(durable_name="guardian-status", ack_policy=AckPolicy.EXPLICIT)
            )
            events = [step(k, job_id="j1") for k in range(10)]
            for e in events:
                await bus.publish(subjects.step("j1"), e)
            sub = await js.pull_subscribe(
                subjects.ALL_STEPS, durable="telemetry-steps", stream=subjects.LEGACY_STEPS
            )
            for msg in await sub.fetch(6):
                await msg.ack_sync()  # the slowest consumer has had steps 0-5

            await bus.ensure_streams()
            await bus.ensure_streams()  # again: nothing left to move

            names = {s.config.name for s in await js.streams_info()}
            assert subjects.LEGACY_STEPS not in names
            jobs = await js.stream_info(subjects.JOBS.name)
            assert subjects.ALL_STEPS in jobs.config.subjects
            copied = [await js.get_msg(subjects.JOBS.name, seq) for seq in range(1, jobs.state.last_seq + 1)]
            assert [m.headers["Nats-Msg-Id"] for m in copied] == [e.event_id for e in events[6:]]
            assert [c.name for c in await js.consumers_info(subjects.JOBS.name)] == []
            await bus.publish(subjects.step("j1"), step(10, job_id="j1"))  # new steps land in VIGIL_JOBS
            assert (await js.stream_info(subjects.JOBS.name)).state.messages == 5
        finally:
            await bus.close()
