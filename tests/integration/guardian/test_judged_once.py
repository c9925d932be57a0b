"""Every step judged exactly once: by a guardian restarted mid-job, and by one started after the job.

Real NATS and Postgres. Exactly once shows as: each fault gives one incident (none missed, none twice),
and the guardian's saved input cursor covers every event published.
"""

from __future__ import annotations

import contextlib

import nats.js.errors
import pytest

from tests.helpers import eventually, service, stored
from tests.integration.guardian.test_guardian import Job, cfg, judged, ready, take
from vigil_common import lease, subjects
from vigil_common.bus import Bus
from vigil_guardian.main import run
from vigil_guardian.service import INPUTS, cursor_key, last_stored

pytestmark = pytest.mark.integration


async def _stored_seq(bus: Bus, job_id: str) -> int | None:
    """Where the job's last event (its last step) stands in VIGIL_JOBS, its share's input."""
    return await last_stored(bus, job_id)


async def held_since(pool, job_id: str, since) -> bool:  # type: ignore[no-untyped-def]
    """A guardian whose lock connection was made after `since` holds the job's share."""
    share = subjects.share_of(job_id)
    found = await lease.holders(pool)
    return any(h.role == "guardian" and h.since > since and share in h.shares for h in found)


async def incidents_stored(bus: Bus, job_id: str) -> int:
    """The job's incidents VIGIL_INCIDENTS holds (a duplicate id is dropped by JetStream; any other counts)."""
    return await stored(bus, subjects.INCIDENTS, subjects.incident(job_id))


async def _cursor(pool, job_id: str) -> int:  # type: ignore[no-untyped-def]
    key = cursor_key(subjects.share_of(job_id))
    return await pool.fetchval("SELECT seq FROM guardian_cursor WHERE stream = $1", key) or 0


async def test_a_guardian_restarted_twice_mid_job_judges_each_fault_once(
    bus, pool, nats_url, migrated, tmp_path, job_id
):
    job = Job(bus, job_id, spike_warmup=10, spike="alert", hang_timeout_s=600, hang_step_multiple=1000)
    settings = cfg(nats_url, migrated, tmp_path)
    async with bus.watch(subjects.incident(job_id)) as incidents:
        async with service(run, settings):
            await eventually(lambda: ready(bus), what="the guardian's consumers")
            await job.launch()
            await job.checkpoint(0)
            await job.steps(0, 12)
            await job.step(12, 0, loss=80.0)  # fault 1, judged by the first guardian
            await job.step(12, 1)
            (first,) = await take(incidents, 1)
            await eventually(lambda: judged(bus, job_id), what="the first guardian idle")
        await job.steps(13, 20)  # while it is down
        await job.step(20, 1, loss=90.0)  # fault 2, published while no guardian runs
        await job.step(20, 0)
        async with service(run, settings):
            (second,) = await take(incidents, 1, timeout=30)
            await job.steps(21, 28)
            await eventually(lambda: judged(bus, job_id), what="the second guardian idle")
        started = await pool.fetchval("SELECT now()")
        async with service(run, settings):  # a third start with nothing new: nothing judged again
            # only the third guardian can hold the share from a lock connection made after `started`
            await eventually(lambda: held_since(pool, job_id, started), what="the third guardian's share")
            await eventually(lambda: judged(bus, job_id), what="the third guardian caught up")
            assert await incidents_stored(bus, job_id) == 2  # the stream's count: none again, late or not
            await job.step(28, 0, loss=95.0)  # fault 3, after the restart
            await job.step(28, 1)
            (third,) = await take(incidents, 1, timeout=30)
            await eventually(lambda: judged(bus, job_id), what="the third guardian idle")
            assert await incidents_stored(bus, job_id) == 3
    assert [(i.kind, i.step, i.rank) for i in (first, second, third)] == [
        ("spike", 12, 0),
        ("spike", 20, 1),
        ("spike", 28, 0),
    ]
    assert second.evidence["window"] >= 10  # the windows were rebuilt from the steps judged before
    assert await _cursor(pool, job_id) >= 1
    await job.end()


async def test_a_guardian_started_after_the_job_judges_it_from_its_start_once(
    bus, pool, nats_url, migrated, tmp_path, job_id
):
    # A fresh deployment's guardian: no consumer yet, no saved state (its own database).
    await pool.execute("DELETE FROM guardian_jobs; DELETE FROM guardian_cursor")
    for spec in INPUTS:
        with contextlib.suppress(nats.js.errors.NotFoundError):
            await bus.js.delete_consumer(spec.stream.name, spec.durable)
    quiet = {"spike": "alert", "hang_timeout_s": 600, "hang_step_multiple": 1000}
    ended = Job(bus, job_id + "e", spike_warmup=10, **quiet)
    await ended.launch()
    await ended.steps(0, 12)
    await ended.step(12, 0, loss=70.0)  # a fault in a job that has ended since: not judged now
    await ended.end()
    job = Job(bus, job_id, spike_warmup=10, **quiet)
    await job.launch()
    await job.checkpoint(0)
    await job.steps(0, 12)
    await job.step(12, 1, loss=80.0)  # before the guardian exists
    await job.step(12, 0)
    await job.steps(13, 20)
    upto = await eventually(lambda: _stored_seq(bus, job_id), what="the last step copied")
    settings = cfg(nats_url, migrated, tmp_path)
    async with bus.watch(subjects.incident(job_id), subjects.incident(job_id + "e")) as incidents:
        async with service(run, settings):
            (found,) = await take(incidents, 1, timeout=30)
            await eventually(lambda: judged(bus, job_id), what="the guardian caught up")
            await eventually(lambda: _cursor(pool, job_id), what="the saved cursor")
        async with service(run, settings):  # restarted: the replayed events are not judged again
            await eventually(lambda: ready(bus), what="the guardian's consumers")
            await job.step(20, 0, loss=90.0)
            await job.step(20, 1)
            (later,) = await take(incidents, 1, timeout=30)
            await eventually(lambda: judged(bus, job_id), what="the restarted guardian idle")
    # by the stream, not by a silence: the guardian publishes an incident before it acknowledges its cause
    assert await incidents_stored(bus, job_id) == 2 and await incidents_stored(bus, job_id + "e") == 0
    assert (found.job_id, found.kind, found.step, found.rank) == (job_id, "spike", 12, 1)
    assert found.evidence["window"] >= 10  # judged from the job's first step
    assert (later.job_id, later.step) == (job_id, 20)
    assert await _cursor(pool, job_id) >= upto
    await job.end()
