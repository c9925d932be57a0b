"""Elastic shrink at the scheduler (issue 40 §3), against the real NATS and Postgres: a two-node elastic
job that loses a node with no spare and no free capacity is launched again on the survivor alone, its
LaunchJob carrying the smaller world (ranks 0..W'-1), and runs and finishes at that size."""

from __future__ import annotations

import pytest

from vigil.events import IncidentRaised
from vigil_common import subjects
from vigil_common.bus import Bus

from .conftest import HEARTBEAT_S, exit_rank, launched, next_event, spec, start_ranks, wait_state

pytestmark = pytest.mark.integration


async def test_an_elastic_job_that_lost_a_node_continues_on_the_survivor(scheduler, nodes, bus: Bus) -> None:
    a, b = nodes(slots=2), nodes(slots=2)
    await a.beat()
    await b.beat()
    elastic = spec("shrinks", resources={"nodes": 2, "gpus_per_node": 2, "elastic": {"min_nodes": 1}})
    job = (await scheduler.http.post("/api/v1/jobs", json=elastic)).json()
    first = await launched(bus, job["id"])
    assert first.world_size == 4 and first.spec.resources.elastic is not None
    await start_ranks(bus, first)
    await wait_state(bus, job["id"], "RUNNING")

    victim, survivor = b, a
    await victim.stop()  # the worker dies: no more heartbeats; no spare, no free node
    second = await launched(bus, job["id"], attempt=2, timeout_s=10 * HEARTBEAT_S * 3)
    # The new world: the survivor's 2 devices, ranks 0..1; the spec still says what the job asks for
    assert [(p.rank, p.node, p.local_rank) for p in second.placement] == [
        (0, survivor.name, 0),
        (1, survivor.name, 1),
    ]
    assert second.world_size == 2 and second.spec.resources.world_size == 4
    assert second.spec.train.grad_accum == 1  # the spec's; the ranks multiply it by 4 / 2
    scheduled = await wait_state(bus, job["id"], "SCHEDULED", attempt=2)
    assert (
        "elastic, continues on 1 of 2 nodes (2 of 4 ranks; resources.elastic.min_nodes 1" in scheduled.cause
    )
    assert "train.grad_accum 1 -> 2" in scheduled.cause
    incident = await next_event(bus, subjects.incident(job["id"]), lambda e: isinstance(e, IncidentRaised))
    assert incident.kind == "node_lost" and incident.node == victim.name
    assert incident.evidence["elastic"] == {"min_nodes": 1, "nodes": 2}
    assert "resources.elastic.min_nodes 1" in incident.message

    # The attempt runs and ends at its own size: 2 ranks started, 2 exited 0
    await start_ranks(bus, second)
    await wait_state(bus, job["id"], "RUNNING", attempt=2)
    for rank in range(second.world_size):
        await exit_rank(bus, second, rank, 0)
    await wait_state(bus, job["id"], "SUCCEEDED", attempt=2)

    detail = (await scheduler.http.get(f"/api/v1/jobs/{job['id']}")).json()
    assert [(x["attempt"], x["world_size"]) for x in detail["attempts"]] == [(1, 4), (2, 2)]
    assert len(detail["placement"]) == 2


async def test_a_job_that_is_not_elastic_waits_for_a_whole_node(scheduler, nodes, bus: Bus) -> None:
    a, b = nodes(slots=2), nodes(slots=2)
    await a.beat()
    await b.beat()
    job = (await scheduler.http.post("/api/v1/jobs", json=spec("waits", nodes=2, per_node=2))).json()
    first = await launched(bus, job["id"])
    await start_ranks(bus, first)
    await wait_state(bus, job["id"], "RUNNING")
    await b.stop()
    await wait_state(bus, job["id"], "PENDING", attempt=2, timeout_s=10 * HEARTBEAT_S * 3)
    c = nodes(slots=2)  # a whole node frees: the job runs again at its size
    await c.beat()
    second = await launched(bus, job["id"], attempt=2)
    assert second.world_size == 4
