"""A worker's user publishes step and status events only on its own node's subjects: never on another
node's, nor on the control plane's (`_control`), where the scheduler alone reports a job's state.
With one credential for every rank, the probe published on any job's subjects."""

from __future__ import annotations

from collections.abc import Awaitable, Callable

import pytest

from tests.integration.secured import refused
from tests.unit.common.samples import SAMPLES
from vigil.errors import RetryableError
from vigil.events import JobStateChanged, Message, RankExited, StepCompleted
from vigil_common import credentials, subjects
from vigil_common.bus import Bus
from vigil_common.embedded import EmbeddedNats

pytestmark = [pytest.mark.integration, pytest.mark.security]

WORKER = credentials.worker_role("n1")


def sample(kind: type[Message], **update: object) -> Message:
    return kind.model_validate({**SAMPLES[kind].model_dump(), **update})


def forged(job_id: str) -> list[tuple[str, Message]]:
    on = {"job_id": job_id, "attempt": 1}
    return [
        (subjects.step(job_id, "n2"), sample(StepCompleted, **on, node="n2")),
        (subjects.status(job_id, "n2"), sample(RankExited, **on, node="n2", exit_code=0, failure="ok")),
        (
            subjects.status(job_id, subjects.CONTROL),
            sample(JobStateChanged, **on, from_state="RUNNING", to_state="SUCCEEDED"),
        ),
    ]


@pytest.mark.parametrize("which", range(3), ids=["other-node-step", "other-node-status", "control-status"])
async def test_a_worker_cannot_publish_for_another_node_or_the_control_plane(
    server: EmbeddedNats, connect: Callable[[str], Awaitable[Bus]], admin: Bus, job_id: str, which: int
) -> None:
    subject, event = forged(job_id)[which]
    refusals = await refused(server, WORKER, lambda nc: nc.publish(subject, event.to_bytes()))
    assert refusals.of("publish", subject), refusals.seen
    worker = await connect(WORKER)
    with pytest.raises(RetryableError):  # through the bus: the server refuses, no ack comes
        await worker.publish(subject, event, timeout_s=1.0)
    assert await admin.last_stored(subjects.JOBS.name, subject) is None  # in either form
