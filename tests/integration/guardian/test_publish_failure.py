"""A decision whose publishing fails is not lost: the event's redelivery publishes it.

The guardian judges each event once (a redelivered step is recognised and not judged again), so
the decision itself must survive a failed attempt. Real NATS (its own server, whose command
stream this test deletes) and Postgres.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import AsyncIterator
from typing import Any

import pytest

from tests.helpers import stored
from tests.integration.guardian.test_guardian import Job, take
from vigil.errors import RetryableError
from vigil.events import Message
from vigil_common import subjects
from vigil_common.bus import Bus
from vigil_common.embedded import EmbeddedNats
from vigil_guardian.core import Guardian
from vigil_guardian.notifier import Notifier
from vigil_guardian.service import GuardianService

pytestmark = pytest.mark.integration


class Recorded(Bus):
    """A bus that also records the launch, status and step events it publishes, for the test to hand
    to the guardian as its consumers would."""

    sent: list[Message]
    commands_open: asyncio.Event  # a command's publish waits for it (set: no wait)
    command_waiting: asyncio.Event  # a command's publish has begun

    async def publish(self, subject: str, event: Message, *, timeout_s: float = 10.0):  # type: ignore[no-untyped-def]
        if subjects.kind_of(subject) == "cmd":
            self.command_waiting.set()
            await self.commands_open.wait()
        ack = await super().publish(subject, event, timeout_s=timeout_s)
        if subjects.kind_of(subject) in ("launch", "status", "step"):
            self.sent.append(event)
        return ack


@pytest.fixture
async def own_bus(server_dir) -> AsyncIterator[Recorded]:
    with EmbeddedNats(server_dir / "nats") as server:
        bus = await Recorded.connect(server.url, "test-publish-failure")
        bus.sent = []
        bus.commands_open = asyncio.Event()
        bus.commands_open.set()
        bus.command_waiting = asyncio.Event()
        await bus.ensure_streams()
        yield bus  # type: ignore[misc]
        await bus.close()


async def judged_four_steps(
    bus: Recorded, pool: Any, job_id: str, publish_timeout_s: float
) -> tuple[GuardianService, Job]:
    """A guardian that has judged a job's launch, checkpoint 0 and four clean steps."""
    guardian = GuardianService(Guardian(), bus, pool, Notifier([]), publish_timeout_s=publish_timeout_s)
    job = Job(bus, job_id)
    await job.launch()
    await job.checkpoint(0)
    await job.steps(0, 4)
    for event in bus.sent:
        await guardian.handle(event)
    bus.sent.clear()
    return guardian, job


async def test_a_halt_that_failed_to_publish_goes_out_when_the_step_comes_back(own_bus, pool, job_id):
    bus = own_bus
    guardian, job = await judged_four_steps(bus, pool, job_id, publish_timeout_s=0.3)

    await bus.js.delete_stream(subjects.COMMANDS.name)  # commands cannot be stored: publishing fails
    await job.step(4, 0, math.nan, skipped=True)
    (nan_step,) = bus.sent
    with pytest.raises(RetryableError):
        await guardian.handle(nan_step)  # the consumer naks; the step comes back later
    with pytest.raises(RetryableError):
        await guardian.handle(nan_step)  # still failing: still owed

    await bus.ensure_streams()
    await guardian.handle(nan_step)  # the redelivery: already judged, and its decision goes out now
    async with bus.watch(subjects.cmd(job_id), from_start=True) as commands:
        halt, rollback = await take(commands, 2)
    assert (halt.type, rollback.type) == ("job.halt", "job.rollback")
    assert rollback.step == 0 and halt.incident_id == rollback.incident_id
    saved = await pool.fetchrow("SELECT kind, action FROM guardian_incidents WHERE job_id = $1", job_id)
    assert tuple(saved) == ("nan", "rollback")

    await guardian.handle(nan_step)  # once out, never again
    # handle() returns after its publishes are stored: the stream's count is the whole story
    assert await stored(bus, subjects.COMMANDS, subjects.cmd(job_id)) == 2


async def test_two_callers_publish_an_owed_decision_once(own_bus, pool, job_id):
    """The job input and the device verdicts both publish what is owed: a second caller while the first
    is mid-publish must not publish the same decision again (nor fail on the list the first emptied)."""
    bus = own_bus
    guardian, job = await judged_four_steps(bus, pool, job_id, publish_timeout_s=5.0)

    await job.step(4, 0, math.nan, skipped=True)
    (nan_step,) = bus.sent
    bus.commands_open.clear()  # the first caller stops inside its first command's publish
    first = asyncio.create_task(guardian.handle(nan_step))
    await asyncio.wait_for(bus.command_waiting.wait(), timeout=10)
    second = asyncio.create_task(guardian.publish_owed())
    await asyncio.sleep(0)  # the second caller is in publish_owed before the first goes on
    bus.commands_open.set()
    await asyncio.wait_for(asyncio.gather(first, second), timeout=10)
    async with bus.watch(subjects.cmd(job_id), from_start=True) as commands:
        halt, rollback = await take(commands, 2)
        assert (halt.type, rollback.type) == ("job.halt", "job.rollback")
    assert await stored(bus, subjects.COMMANDS, subjects.cmd(job_id)) == 2  # each once, both callers done
