"""No role creates, updates, pulls from or deletes a consumer it does not own. The probe's route: a
credential re-filtered the guardian's durable consumer to nothing (`$JS.API.CONSUMER.CREATE.*` was in
every allow list) and the guardian went blind; the telemetry credential deleted a consumer it did not
own."""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable

import pytest
from nats.js.api import AckPolicy, ConsumerConfig

from tests.integration.secured import refused
from vigil_common import credentials, subjects
from vigil_common.bus import Bus
from vigil_common.embedded import EmbeddedNats
from vigil_guardian.service import share_input

pytestmark = [pytest.mark.integration, pytest.mark.security]

JOBS = subjects.JOBS.name
INPUT = share_input(0)  # one of the guardian's share consumers
NAME = INPUT.durable
NOTHING = subjects.launch("j-nothing")  # a filter that matches no job's events
WORKER = credentials.worker_role("n1")


def refilter(name: str = INPUT.durable) -> bytes:
    """A create request that re-filters the consumer `name` to NOTHING."""
    config = {
        "name": name,
        "durable_name": name,
        "deliver_subject": "_INBOX.hijacked",
        "filter_subject": NOTHING,
        "ack_policy": "explicit",
    }
    return json.dumps({"stream_name": JOBS, "config": config}).encode()


@pytest.fixture
async def guardians(connect: Callable[[str], Awaitable[Bus]], admin: Bus) -> str:
    """The guardian's durable consumer, made by the guardian's own user as its service makes it; its
    deliver subject."""
    guardian = await connect(credentials.GUARDIAN)
    info = await guardian.js.add_consumer(
        JOBS,
        ConsumerConfig(
            name=INPUT.durable,
            durable_name=INPUT.durable,
            deliver_subject=guardian.nc.new_inbox(),
            filter_subject=INPUT.filter_subject,
            ack_policy=AckPolicy.EXPLICIT,
        ),
    )
    assert info.config.deliver_subject
    return info.config.deliver_subject


@pytest.mark.parametrize(
    ("role", "subject", "body"),
    [
        # update, with the name and filter in the subject as nats-py sends it
        (WORKER, f"$JS.API.CONSUMER.CREATE.{JOBS}.{NAME}.{NOTHING}", refilter()),
        (WORKER, f"$JS.API.CONSUMER.CREATE.{JOBS}.{NAME}", refilter()),
        # the nameless create, whose body may carry any name
        (WORKER, f"$JS.API.CONSUMER.CREATE.{JOBS}", refilter()),
        (WORKER, f"$JS.API.CONSUMER.DURABLE.CREATE.{JOBS}.{NAME}", refilter()),
        (credentials.TELEMETRY, f"$JS.API.CONSUMER.CREATE.{JOBS}.{NAME}.{NOTHING}", refilter()),
        (credentials.SCHEDULER, f"$JS.API.CONSUMER.CREATE.{JOBS}.{NAME}.{NOTHING}", refilter()),
        # delete
        (credentials.TELEMETRY, f"$JS.API.CONSUMER.DELETE.{JOBS}.{NAME}", b""),
        # pull from (the guardian's scan), read the state of
        (WORKER, f"$JS.API.CONSUMER.MSG.NEXT.{JOBS}.{credentials.guardian_scan(0)}", b'{"batch": 1}'),
        (WORKER, f"$JS.API.CONSUMER.INFO.{JOBS}.{NAME}", b""),
    ],
)
async def test_no_role_creates_updates_pulls_from_or_deletes_the_guardians_consumer(
    server: EmbeddedNats, admin: Bus, guardians: str, role: str, subject: str, body: bytes
) -> None:
    async def attempt(nc):  # type: ignore[no-untyped-def]
        await nc.publish(subject, body, reply=nc.new_inbox())

    refusals = await refused(server, role, attempt)
    assert refusals.of("publish", subject), refusals.seen
    info = await admin.js.consumer_info(JOBS, INPUT.durable)  # still there, as the guardian made it
    assert (info.config.filter_subject, info.config.deliver_subject) == (INPUT.filter_subject, guardians)


async def test_a_role_creates_and_deletes_its_own_consumer(
    connect: Callable[[str], Awaitable[Bus]], admin: Bus
) -> None:
    """The owner's own requests pass: the permissions above refuse by owner, not by kind."""
    telemetry = await connect(credentials.TELEMETRY)
    name = "telemetry-launches"
    await telemetry.js.add_consumer(
        JOBS,
        ConsumerConfig(
            name=name,
            durable_name=name,
            deliver_subject=telemetry.nc.new_inbox(),
            filter_subject=subjects.ALL_LAUNCHES,
            ack_policy=AckPolicy.EXPLICIT,
        ),
    )
    assert (await telemetry.js.consumer_info(JOBS, name)).config.filter_subject == subjects.ALL_LAUNCHES
    assert await telemetry.js.delete_consumer(JOBS, name)
