"""A message pushed into a consumer's deliver inbox, or delivered there by another consumer through a
forged reply subject, is never acted on. The probe's route: a pull request to a consumer of its own
whose reply subject was another job's command inbox delivered that job's old HaltJob and RollbackJob,
with genuine ack subjects; the receiver checked only the stream."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import Awaitable, Callable

import nats.js.errors
import pytest
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy

from tests.helpers import eventually
from tests.integration.secured import refused
from vigil.events import CancelJob, HaltJob, Message
from vigil_common import credentials, subjects
from vigil_common.bus import Bus, Delivery
from vigil_common.embedded import EmbeddedNats
from vigil_worker.consumers import consumers

pytestmark = [pytest.mark.integration, pytest.mark.security]

COMMANDS = subjects.COMMANDS.name
VICTIM = consumers("n2")[1]  # worker n2's command consumer (every job's commands, from now on)


async def test_a_replayed_or_pushed_command_is_not_acted_on(
    server: EmbeddedNats,
    connect: Callable[[str], Awaitable[Bus]],
    admin: Bus,
    job_id: str,
    caplog: pytest.LogCaptureFixture,
) -> None:
    old_job, new_job = job_id, f"{job_id}-b"
    old = HaltJob(job_id=old_job, attempt=1, reason="an old command of another job")
    await admin.publish(subjects.cmd(old_job), old)  # stored before the victim starts: not its to see
    with contextlib.suppress(nats.js.errors.NotFoundError):
        await admin.js.delete_consumer(COMMANDS, VICTIM.durable)

    worker = await connect(credentials.worker_role("n2"))
    handled: list[Message] = []
    genuine_arrived, stop = asyncio.Event(), asyncio.Event()

    async def handler(event: Message, delivery: Delivery) -> None:
        handled.append(event)
        if isinstance(event, CancelJob):
            genuine_arrived.set()

    victim = asyncio.create_task(worker.consume(VICTIM, handler, stop))
    try:
        info = await eventually(lambda: _info(admin, VICTIM.durable), what="the victim's consumer")
        inbox = info.config.deliver_subject
        assert inbox.startswith("_INBOX_worker-n2.")

        # 1. Another credential pushes a command straight into the inbox, with a forged ack subject.
        forged_ack = f"$JS.ACK.{COMMANDS}.{VICTIM.durable}.1.1.1.1700000000000000000.0"

        async def push(nc):  # type: ignore[no-untyped-def]
            await nc.publish(inbox, old.to_bytes(), reply=forged_ack)

        refusals = await refused(server, credentials.worker_role("n1"), push)
        assert refusals.of("publish", inbox), refusals.seen

        # 2. A pull from another consumer whose reply subject is the victim's inbox: a genuine delivery,
        # with a genuine ack subject, by the wrong consumer. The roles may pull only from consumers of
        # their own; admin (which may do anything) stands for a credential that had such a consumer.
        await admin.js.add_consumer(
            COMMANDS,
            ConsumerConfig(
                name="replay",
                durable_name="replay",
                filter_subject=subjects.cmd(old_job),
                ack_policy=AckPolicy.EXPLICIT,
                deliver_policy=DeliverPolicy.ALL,
            ),
        )
        await admin.nc.publish(
            f"$JS.API.CONSUMER.MSG.NEXT.{COMMANDS}.replay", json.dumps({"batch": 1}).encode(), reply=inbox
        )
        await eventually(lambda: _delivered(admin, "replay"), what="the replay delivered into the inbox")

        # a genuine command after both: the victim goes on, and has acted on nothing before it
        genuine = CancelJob(job_id=new_job, attempt=1, reason="genuine")
        await admin.publish(subjects.cmd(new_job), genuine)
        await asyncio.wait_for(genuine_arrived.wait(), 10)
    finally:
        stop.set()
        await asyncio.wait_for(victim, 10)
        with contextlib.suppress(nats.js.errors.NotFoundError):
            await admin.js.delete_consumer(COMMANDS, "replay")
    assert handled == [genuine]
    # it did arrive, and was dropped as another consumer's delivery
    assert any("delivered by consumer 'replay'" in r.getMessage() for r in caplog.records), caplog.text


async def _info(admin: Bus, name: str):  # type: ignore[no-untyped-def]
    try:
        return await admin.js.consumer_info(COMMANDS, name)
    except nats.js.errors.NotFoundError:
        return None


async def _delivered(admin: Bus, name: str) -> bool:
    return (await admin.js.consumer_info(COMMANDS, name)).delivered.consumer_seq == 1
