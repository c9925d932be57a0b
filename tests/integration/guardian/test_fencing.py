"""Fencing a share's state: a guardian whose lock lapsed (paused past its lease, cut off from Postgres)
and that runs on once its share has moved is refused, in what it saves and in what it decides, and its
successor's state stands. Real NATS and Postgres; two guardians' services judging the same share."""

from __future__ import annotations

import asyncio
import json
import math

import pytest

from tests.integration.guardian.test_guardian import Job
from tests.integration.guardian.test_publish_failure import own_bus  # noqa: F401 (a fixture)
from vigil_common import subjects
from vigil_guardian import store
from vigil_guardian.core import Guardian
from vigil_guardian.notifier import Notifier
from vigil_guardian.service import GuardianService

pytestmark = pytest.mark.integration


async def saved_state(pool, job_id: str) -> dict:
    return json.loads(await pool.fetchval("SELECT state FROM guardian_jobs WHERE job_id = $1", job_id))


async def test_a_guardian_that_resumes_after_its_share_moved_can_neither_save_nor_decide(
    own_bus,  # noqa: F811
    pool,
    job_id,
):
    bus, share = own_bus, subjects.share_of(job_id)
    first = GuardianService(Guardian(), bus, pool, Notifier([]), share=share)
    first.fence = await store.take_epoch(pool, share, "first@test")
    job = Job(bus, job_id)
    await job.launch()
    await job.checkpoint(0)
    await job.steps(0, 3)
    for event in bus.sent:
        await first.handle(event)
    bus.sent.clear()

    # The first is paused; its lock lapses and the second takes the share: its epoch, then its state.
    second = GuardianService(Guardian(), bus, pool, Notifier([]), share=share)
    second.fence = await store.take_epoch(pool, share, "second@test")
    assert second.fence.epoch == first.fence.epoch + 1
    assert job_id in (await store.load(pool, "test-cursor", share)).jobs
    await job.checkpoint(3)
    for event in bus.sent:
        await second.handle(event)
    bus.sent.clear()
    theirs = await saved_state(pool, job_id)

    # The first resumes with its older view: a NaN step it judges decides nothing and saves nothing.
    await job.step(3, 0, math.nan, skipped=True)
    (nan_step,) = bus.sent
    with pytest.raises(store.Fenced) as refused:
        await first.handle(nan_step)
    assert (refused.value.epoch, refused.value.newest) == (first.fence.epoch, second.fence.epoch)
    assert await saved_state(pool, job_id) == theirs, "the fenced guardian wrote over its successor's state"
    async with bus.watch(subjects.cmd(job_id), from_start=True) as commands:
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(anext(commands), 0.5)  # no halt, no rollback from the fenced one

    # On its input the fenced one stops judging the share at once (never retries against the fence).
    stop = asyncio.Event()
    with pytest.raises(store.Fenced):
        await first._retrying(lambda: first.persist({job_id}), stop)
    assert stop.is_set()

    # The holder of the newest epoch saves and decides as before.
    await second.handle(nan_step)
    async with bus.watch(subjects.cmd(job_id), from_start=True) as commands:
        halt = await asyncio.wait_for(anext(commands), 10)
    assert halt.type == "job.halt"
