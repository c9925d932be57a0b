"""A hot spare (issue 40 §1) on three hosts (network namespaces): with `VIGIL_HOT_SPARES=1` hostc is held in
reserve and shown so; a 2-node job runs on hosta and hostb, and a 1-node job queued behind it is not
placed on the spare. Host b is cut off (then its worker and rank killed): the job is relaunched at once on hosta and
the spare, ahead of the queued job, hosta's rank in its own process (its worker cut its collectives), and SUCCEEDS;
once it ends the reserve refills and the queued job runs."""

from __future__ import annotations

import time
from typing import Any

import pytest

from tests.integration.scheduler.conftest import launched, next_event, wait_state
from tests.integration.worker.conftest import tiny_spec
from vigil.events import CheckpointSaved, IncidentRaised, RankStarted
from vigil_bench.netns import Network
from vigil_common import subjects

from .conftest import Plane, Workers, stored_steps, unique, wait_alive

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.multihost]

HOSTS = ["a", "b", "c"]
# Silence ends a node after 20 heartbeats (10 s): a killed host's loss is known sooner, from stronger
# evidence (`test_a_host_killed_mid_run_costs_a_relaunch_on_the_spare_from_memory`).
PLANE = {"hot_spares": 1, "node_lost_after": 20}


def spec(name: str, nodes: int, **train: Any) -> dict[str, Any]:
    s = tiny_spec(**train)
    s["name"] = unique(name)
    s["resources"] = {"nodes": nodes, "gpus_per_node": 1}
    return s


async def spares(plane: Plane) -> list[str]:
    items = (await plane.http.get("/api/v1/nodes")).json()["items"]
    return [n["name"] for n in items if n["spare"]]


async def rank_pid(plane: Plane, job_id: str, rank: int, attempt: int) -> int:
    """The process that ran `rank` of the job's `attempt` (its `RankStarted`)."""
    started = await next_event(
        plane.bus,
        subjects.job_status(job_id),
        lambda e: isinstance(e, RankStarted) and e.attempt == attempt and e.rank == rank,
    )
    assert isinstance(started, RankStarted)
    return started.pid


async def test_a_job_that_loses_a_node_is_relaunched_on_the_spare_ahead_of_the_queue(
    plane: Plane, workers: Workers, network: Network
) -> None:
    a, b, c = network.hosts
    wa, wb, wc = workers.start(a), workers.start(b), workers.start(c)
    await wait_alive(plane, workers, wa.node, wb.node, wc.node)
    assert await spares(plane) == [wc.node]  # the last whole free node by name

    body = spec("mh-spare", 2, steps=16, checkpoint={"every": 4})
    # the node's loss is what is tested: the hang detector (rank 1 silent, its node's stacks never coming)
    # must not restart the job first. On a loaded machine it did, at 7.4 s, before the 20 silent heartbeats
    # (10 s), and the scheduler placed that restart on hostb again (not yet lost)
    body["guardian"] = {"hang_floor_s": 60}
    job_id = await plane.submit(body)
    first = await launched(plane.bus, job_id, timeout_s=30)
    assert sorted(p.node for p in first.placement) == [wa.node, wb.node]  # never on the spare
    queued = await plane.submit(spec("mh-queued", 1, steps=4))
    await next_event(
        plane.bus,
        subjects.job_status(job_id),
        lambda e: isinstance(e, CheckpointSaved) and e.step >= 4,
        timeout_s=180,
    )
    job = (await plane.http.get(f"/api/v1/jobs/{queued}")).json()
    assert job["state"] == "PENDING", job  # the spare is free, but not the queue's

    b.cut()  # the machine is gone (cut off, so its rank's peer sees no closed connection first)
    try:
        await wait_state(plane.bus, job_id, "PENDING", timeout_s=30, cause=f"node {wb.node} lost")
    finally:
        workers.kill(b)  # its worker and rank, before its link comes back
        b.reconnect()
    lost = await next_event(
        plane.bus,
        subjects.incident(job_id),
        lambda e: isinstance(e, IncidentRaised) and e.kind == "node_lost",
    )
    assert isinstance(lost, IncidentRaised) and lost.node == wb.node
    second = await launched(plane.bus, job_id, attempt=2, timeout_s=30)
    assert sorted(p.node for p in second.placement) == [wa.node, wc.node]  # the spare, taken at once
    assert second.resume_from is not None
    job = (await plane.http.get(f"/api/v1/jobs/{queued}")).json()
    assert job["state"] == "PENDING", job  # the queued job went behind: hosta and hostc are taken
    await wait_state(plane.bus, job_id, "SUCCEEDED", timeout_s=240)
    # hosta's rank waited on a peer cut off (no connection closed); told by its worker that attempt 2
    # replaced its own, it cut its collectives' connections, parked, and went on in its own process
    (kept,) = [p.rank for p in first.placement if p.node == wa.node]
    assert [p.node for p in second.placement if p.rank == kept] == [wa.node]
    pids = [await rank_pid(plane, job_id, kept, attempt) for attempt in (1, 2)]
    assert pids[0] == pids[1], pids

    # the job's nodes are free again: hostc is the spare again, and the queued job runs on hosta
    third = await launched(plane.bus, queued, timeout_s=60)
    assert [p.node for p in third.placement] == [wa.node]
    await wait_state(plane.bus, queued, "SUCCEEDED", timeout_s=240)
    assert await spares(plane) == [wc.node]


KILL_AT = 10
MEMORY_EVERY = 1


async def test_a_host_killed_mid_run_costs_a_relaunch_on_the_spare_from_memory(
    plane: Plane, workers: Workers, network: Network
) -> None:
    """Host b dies (its worker and rank SIGKILLed) mid-run. Its loss is known as soon as the survivor's
    collective fails (its worker's connection is closed: the scheduler's ping is answered "no
    responders"). The survivor parks in its process; the job goes on there and on the spare (in-job
    restart), from the in-memory snapshots (the lost rank's shard from its peer copy on hosta: the only
    disk checkpoint is step 0's), redoing at most `memory_every` + 1 steps (a snapshot is whole one step
    after it is taken), and every loss after the restore is the fault-free run's."""
    a, b, c = network.hosts
    wa, wb, wc = workers.start(a), workers.start(b), workers.start(c)
    await wait_alive(plane, workers, wa.node, wb.node, wc.node)
    steps = {"steps": 24, "checkpoint": {"every": 100, "memory_every": MEMORY_EVERY}}
    reference = await plane.submit(spec("mh-reference", 2, **steps))
    await wait_state(plane.bus, reference, "SUCCEEDED", timeout_s=240)

    job_id = await plane.submit(spec("mh-killed", 2, **steps))
    first = await launched(plane.bus, job_id, timeout_s=30)
    assert sorted(p.node for p in first.placement) == [wa.node, wb.node]
    await next_event(
        plane.bus, subjects.step(job_id, wb.node), lambda e: getattr(e, "step", -1) >= KILL_AT, timeout_s=180
    )
    workers.kill(b)
    killed = time.time()
    await wait_state(plane.bus, job_id, "PENDING", timeout_s=30, cause=f"node {wb.node} lost")
    # known from the survivor's failed collective and the dead worker's closed connection, not from
    # 20 missed heartbeats
    lost = await next_event(
        plane.bus,
        subjects.incident(job_id),
        lambda e: isinstance(e, IncidentRaised) and e.kind == "node_lost",
    )
    assert isinstance(lost, IncidentRaised) and lost.node == wb.node, lost
    assert "worker's connection is closed, and rank 0 on" in lost.message, lost.message
    second = await launched(plane.bus, job_id, attempt=2, timeout_s=30)
    assert sorted(p.node for p in second.placement) == [wa.node, wc.node]
    # the only disk checkpoint is the start's (step 0): a relaunch that goes on past it restored memory
    assert (second.resume_from or "").endswith("step_00000000"), second.resume_from
    await wait_state(plane.bus, job_id, "SUCCEEDED", timeout_s=240)
    # in-job restart: hosta's rank failed its collective, parked, and went on in its own process
    (kept,) = [p.rank for p in first.placement if p.node == wa.node]
    pids = [await rank_pid(plane, job_id, kept, attempt) for attempt in (1, 2)]
    assert [p.node for p in second.placement if p.rank == kept] == [wa.node]
    assert pids[0] == pids[1], pids

    ref, got = await stored_steps(plane, reference, job_id)
    last1 = max(s for (at, s, _) in got if at == 1)
    first2 = min(s for (at, s, _) in got if at == 2)
    resumed = min(r["occurred_at"].timestamp() for (at, _, _), r in got.items() if at == 2)
    print(f"\nkilled after step {last1}; resumed at step {first2}, {resumed - killed:.2f}s after the kill")
    assert KILL_AT <= first2 <= last1 + 1 and last1 + 1 - first2 <= MEMORY_EVERY + 1, (last1, first2)
    assert {s for (at, s, _) in got if at == 2} == set(range(first2, 24))
    for (at, s, rank), r in got.items():
        assert r["loss"] == pytest.approx(ref[(s, rank)], rel=1e-6), (at, s, rank)
