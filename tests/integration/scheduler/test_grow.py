"""Elastic grow at the scheduler (issue 40 §3), against the real NATS and Postgres: a two-node elastic job
running shrunk on one node grows back to both at its next checkpoint boundary after capacity returns (its
attempt ends, the next resumes from that checkpoint at the whole size), the queue treating the growth as a
placement of the job's own: a job ahead of it takes returned capacity first. A grow is no failed attempt."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from vigil.events import IncidentRaised
from vigil_common import subjects
from vigil_common.bus import Bus

from .conftest import (
    HEARTBEAT_S,
    FakeNode,
    Running,
    checkpoint,
    exit_rank,
    launched,
    next_event,
    running,
    scheduler_settings,
    spec,
    start_ranks,
    wait_state,
)

pytestmark = pytest.mark.integration

LOST_S = 10 * HEARTBEAT_S * 3  # bound on noticing a silent node


def elastic(name: str, **extra: Any) -> dict[str, Any]:
    return spec(name, resources={"nodes": 2, "gpus_per_node": 2, "elastic": {"min_nodes": 1}}, **extra)


async def until(scheduler, query: str, *args: Any, timeout_s: float = 10.0) -> None:
    """Until `query` answers true in the scheduler's database: what it stored, where no event tells."""
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not await scheduler.pool.fetchval(query, *args):
        if asyncio.get_running_loop().time() > deadline:
            raise TimeoutError(f"not true in {timeout_s}s: {query} {args}")
        await asyncio.sleep(0.05)  # polling the database for a row


async def known(scheduler, node: FakeNode) -> None:
    """Until the scheduler has stored the node's heartbeat: heartbeats and status events come on separate
    consumers, so a heartbeat published before a checkpoint may be stored after it."""
    await until(scheduler, "SELECT EXISTS (SELECT 1 FROM devices WHERE node = $1)", node.name)


async def handled(scheduler, bus: Bus, job: str, node: FakeNode) -> None:
    """Until every status event published so far is handled (the status consumer goes in order): a late
    checkpoint of attempt 1 (it grows nothing) is published and waited for."""
    await checkpoint(bus, job, 1, 1, node.name)
    await until(
        scheduler, "SELECT EXISTS (SELECT 1 FROM scheduler_checkpoints WHERE job_id = $1 AND step = 1)", job
    )


async def running_shrunk(scheduler, nodes, bus: Bus, name: str) -> tuple[str, FakeNode]:
    """An elastic 2 x 2 job on two nodes, one of which dies: it runs shrunk on the other (attempt 2)."""
    a, b = nodes(slots=2), nodes(slots=2)
    await a.beat()
    await b.beat()
    job = (await scheduler.http.post("/api/v1/jobs", json=elastic(name))).json()["id"]
    await start_ranks(bus, await launched(bus, job))
    await wait_state(bus, job, "RUNNING")
    await b.stop()
    shrunk = await launched(bus, job, attempt=2, timeout_s=LOST_S)
    assert shrunk.world_size == 2 and {p.node for p in shrunk.placement} == {a.name}
    await start_ranks(bus, shrunk)
    await wait_state(bus, job, "RUNNING", attempt=2)
    return job, a


@pytest.fixture
async def two_attempts(db_url: str, nats_url: str, tmp_path: Path) -> AsyncIterator[Running]:
    """A scheduler that fails a job at its third counted attempt (VIGIL_MAX_ATTEMPTS 2)."""
    async with running(scheduler_settings(db_url, nats_url, tmp_path, max_attempts=2)) as started:
        yield started


async def test_a_shrunk_job_grows_back_at_its_next_checkpoint_once_capacity_returns(
    two_attempts: Running, nodes, bus: Bus
) -> None:
    """Attempt 1 lost a node, attempt 2 runs shrunk and ends to grow: with 2 attempts allowed, attempt 3
    runs, as the grow is no failure."""
    scheduler = two_attempts
    job, a = await running_shrunk(scheduler, nodes, bus, "grows")
    await checkpoint(bus, job, 2, 4, a.name)  # no room yet: it runs on shrunk
    await handled(scheduler, bus, job, a)

    c = nodes(slots=2)  # capacity returns; nothing happens before the job's next checkpoint boundary
    await c.beat()
    await known(scheduler, c)
    path = await checkpoint(bus, job, 2, 8, a.name)
    ended = await wait_state(bus, job, "ROLLING_BACK", attempt=3)
    assert ended.cause == (
        "grow back to 2 nodes (capacity returned): attempt 3 resumes at 4 ranks from the checkpoint of step 8"
    )
    grown = await launched(bus, job, attempt=3)
    assert grown.world_size == 4 and grown.resume_from == path
    assert sorted((p.node, p.device) for p in grown.placement) == sorted(
        (n, d) for n in (a.name, c.name) for d in (0, 1)
    )  # its own devices on a, and c's
    scheduled = await wait_state(bus, job, "SCHEDULED", attempt=3)
    assert scheduled.cause.endswith(": elastic, grew back to 2 of 2 nodes (capacity returned; 4 ranks)")
    incident = await next_event(
        bus, subjects.incident(job), lambda e: isinstance(e, IncidentRaised) and e.kind == "lifecycle"
    )
    assert incident.message.startswith("grew back to 2 of 2 nodes (capacity returned): attempt 3 on ")
    assert incident.action == "alert" and path in incident.message

    await start_ranks(bus, grown)
    await wait_state(bus, job, "RUNNING", attempt=3)
    for rank in range(4):
        await exit_rank(bus, grown, rank, 0)
    await wait_state(bus, job, "SUCCEEDED", attempt=3)
    detail = (await scheduler.http.get(f"/api/v1/jobs/{job}")).json()
    assert [(x["attempt"], x["world_size"]) for x in detail["attempts"]] == [(1, 4), (2, 2), (3, 4)]


async def test_a_job_ahead_in_the_queue_takes_the_returned_capacity_first(scheduler, nodes, bus: Bus) -> None:
    job, a = await running_shrunk(scheduler, nodes, bus, "waits-its-turn")
    urgent = spec("urgent", nodes=1, per_node=2, priority=5)
    other = (await scheduler.http.post("/api/v1/jobs", json=urgent)).json()["id"]
    c = nodes(slots=2)
    await c.beat()
    placed = await launched(bus, other)  # the queue's head takes c as soon as it is back
    assert {p.node for p in placed.placement} == {c.name}
    await start_ranks(bus, placed)
    await wait_state(bus, other, "RUNNING")
    await checkpoint(bus, job, 2, 4, a.name)  # no room for the whole size: it goes on shrunk

    for rank in range(2):  # the other job ends: c is free again, and the next checkpoint grows the job
        await exit_rank(bus, placed, rank, 0)
    await wait_state(bus, other, "SUCCEEDED")
    await checkpoint(bus, job, 2, 8, a.name)
    ended = await wait_state(bus, job, "ROLLING_BACK", attempt=3)
    assert "from the checkpoint of step 8" in ended.cause  # not step 4's: there was no room then
    grown = await launched(bus, job, attempt=3)
    assert grown.world_size == 4 and sorted({p.node for p in grown.placement}) == sorted([a.name, c.name])
