"""An event id published on one subject suppresses nothing on another. JetStream de-duplicates per
stream; the probe published junk on an unrelated job's subject with another job's launch id (the
scheduler's ids are predictable: `launch-<job>-<attempt>`), and that launch was dropped as a duplicate."""

from __future__ import annotations

import uuid
from collections.abc import Awaitable, Callable

import pytest

from tests.unit.common.samples import SAMPLES
from vigil.events import LaunchJob, StepCompleted
from vigil_common import credentials, subjects
from vigil_common.bus import Bus

pytestmark = [pytest.mark.integration, pytest.mark.security]


async def test_another_jobs_launch_id_on_a_workers_own_subject_does_not_suppress_the_launch(
    connect: Callable[[str], Awaitable[Bus]], admin: Bus, job_id: str
) -> None:
    launch_id = f"launch-{job_id}-1"  # what the scheduler will publish the launch as
    elsewhere = f"j-{uuid.uuid4().hex[:12]}"
    worker = await connect(credentials.worker_role("n1"))
    junk = SAMPLES[StepCompleted].model_copy(
        update={"event_id": launch_id, "job_id": elsewhere, "node": "n1"}
    )
    await worker.publish(subjects.step(elsewhere, "n1"), junk)  # its own node's subject: allowed

    scheduler = await connect(credentials.SCHEDULER)
    launch = SAMPLES[LaunchJob].model_copy(update={"event_id": launch_id, "job_id": job_id, "attempt": 1})
    ack = await scheduler.publish(subjects.launch(job_id), launch)
    assert not ack.duplicate
    stored = await admin.last_stored(subjects.JOBS.name, subjects.launch(job_id))
    assert stored is not None and LaunchJob.model_validate_json(stored.data) == launch
    # and a retry of the launch itself is still de-duplicated
    assert (await scheduler.publish(subjects.launch(job_id), launch)).duplicate
