"""No role subscribes to `_INBOX.>` or to another role's inbox, so no credential reads the JetStream
deliveries and API replies of another (the probe read every delivery to every service that way)."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

import pytest
from nats.aio.msg import Msg

from tests.integration.secured import Refusals, raw
from vigil.events import GpuSampled, Message
from vigil_common import credentials, subjects
from vigil_common.bus import Bus, ConsumerSpec, Delivery
from vigil_common.embedded import EmbeddedNats
from vigil_telemetry.main import GPU

pytestmark = [pytest.mark.integration, pytest.mark.security]

ROLES = (credentials.SCHEDULER, credentials.GUARDIAN, credentials.TELEMETRY, credentials.worker_role("n1"))


@pytest.mark.parametrize("role", ROLES)
async def test_no_role_subscribes_to_every_inbox_or_to_anothers(server: EmbeddedNats, role: str) -> None:
    others = [
        f"{credentials.inbox_prefix(r)}.>" for r in (*ROLES, credentials.worker_role("n2")) if r != role
    ]
    refusals = Refusals()
    nc = await raw(server, role, refusals)
    try:
        for inbox in ("_INBOX.>", ">", *others):
            await nc.subscribe(inbox)
        await nc.flush()

        async def every_one_refused() -> None:
            while not all(refusals.of("subscription", s) for s in ("_INBOX.>", ">", *others)):
                refusals.event.clear()
                await refusals.event.wait()

        await asyncio.wait_for(every_one_refused(), 10)
    finally:
        await nc.close()


async def test_a_worker_reads_nothing_a_services_consumer_delivers(
    server: EmbeddedNats, connect: Callable[[str], Awaitable[Bus]], admin: Bus
) -> None:
    """Telemetry consumes a GPU sample; a worker listening on every inbox it may name hears nothing."""
    refusals = Refusals()
    spy = await raw(server, credentials.worker_role("n1"), refusals)
    overheard: list[Msg] = []

    async def on_msg(msg: Msg) -> None:
        overheard.append(msg)

    for inbox in ("_INBOX.>", f"{credentials.inbox_prefix(credentials.TELEMETRY)}.>"):
        await spy.subscribe(inbox, cb=on_msg)
    telemetry = await connect(credentials.TELEMETRY)
    worker = await connect(credentials.worker_role("n2"))
    spec = ConsumerSpec(stream=subjects.NODES, durable=GPU.durable, filter_subject=subjects.gpu("n2"))
    got: list[Message] = []
    done, stop = asyncio.Event(), asyncio.Event()

    async def handler(batch: list[tuple[Message, Delivery]]) -> None:
        got.extend(e for e, _ in batch)
        done.set()

    sample = GpuSampled(node="n2", index=0, device_kind="gpu", uuid="GPU-n2-0", utilization_pct=1.0)
    await worker.publish(subjects.gpu("n2"), sample)  # stored; the consumer delivers it from the start
    consumer = asyncio.create_task(telemetry.consume_batches(spec, handler, stop))
    try:
        await asyncio.wait_for(done.wait(), 15)
        await spy.flush()  # whatever the server sent the spy before now has arrived
    finally:
        stop.set()
        await asyncio.wait_for(consumer, 10)
        await spy.close()
    assert got == [sample]
    assert overheard == [], [m.subject for m in overheard]
    assert refusals.of("subscription", "_INBOX.>"), refusals.seen
