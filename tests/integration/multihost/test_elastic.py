"""An elastic job on two hosts (network namespaces) and no spare (issue 40 §3): host b dies (its worker and
rank SIGKILLed) mid-run. Nothing replaces it, so the job goes on with hosta alone: its rank parked in its
process takes the 1-rank launch, restores both former ranks' in-memory snapshots (rank 1's from the peer
copy hosta holds: the only disk checkpoint is step 0's), re-partitions the ZeRO optimizer state, and
keeps the global batch by 2 micro-steps; every loss after the restore is the mean of the fault-free 2-rank
run's two ranks' losses, and the job SUCCEEDS at 1 rank."""

from __future__ import annotations

import time
from typing import Any

import pytest

from tests.integration.scheduler.conftest import launched, next_event, wait_state
from tests.integration.worker.conftest import tiny_spec
from vigil.events import RankStarted
from vigil_bench.netns import Network
from vigil_common import subjects

from .conftest import Plane, Workers, stored_steps, unique, wait_alive

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.multihost]

HOSTS = ["a", "b"]
PLANE = {"node_lost_after": 20}  # silence ends a node after 10 s: the kill is known sooner
KILL_AT, MEMORY_EVERY, STEPS = 10, 1, 24


def spec(name: str) -> dict[str, Any]:
    s = tiny_spec(steps=STEPS, checkpoint={"every": 100, "memory_every": MEMORY_EVERY})
    s["name"] = unique(name)
    s["resources"] = {"nodes": 2, "gpus_per_node": 1, "elastic": {"min_nodes": 1}}
    return s


async def test_an_elastic_job_that_loses_a_host_goes_on_with_the_other_from_memory(
    plane: Plane, workers: Workers, network: Network
) -> None:
    a, b = network.hosts
    wa, wb = workers.start(a), workers.start(b)
    await wait_alive(plane, workers, wa.node, wb.node)
    reference = await plane.submit(spec("mh-elastic-reference"))
    await wait_state(plane.bus, reference, "SUCCEEDED", timeout_s=240)

    job_id = await plane.submit(spec("mh-elastic"))
    first = await launched(plane.bus, job_id, timeout_s=30)
    assert sorted(p.node for p in first.placement) == [wa.node, wb.node]
    await next_event(
        plane.bus, subjects.step(job_id, wb.node), lambda e: getattr(e, "step", -1) >= KILL_AT, timeout_s=180
    )
    workers.kill(b)
    killed = time.time()
    await wait_state(plane.bus, job_id, "PENDING", timeout_s=30, cause=f"node {wb.node} lost")
    second = await launched(plane.bus, job_id, attempt=2, timeout_s=30)
    assert [(p.rank, p.node) for p in second.placement] == [(0, wa.node)]  # shrunk: hosta alone
    assert second.world_size == 1 and second.spec.resources.world_size == 2
    assert (second.resume_from or "").endswith("step_00000000"), second.resume_from
    await wait_state(plane.bus, job_id, "SUCCEEDED", timeout_s=240)

    (kept,) = [p.rank for p in first.placement if p.node == wa.node]
    pids = [
        await next_event(
            plane.bus,
            subjects.job_status(job_id),
            lambda e, at=at, r=r: isinstance(e, RankStarted) and e.attempt == at and e.rank == r,
        )
        for at, r in ((1, kept), (2, 0))
    ]
    assert pids[0].pid == pids[1].pid, pids  # type: ignore[attr-defined]  # in-job restart, renumbered

    ref, got = await stored_steps(plane, reference, job_id)
    last1 = max(s for (at, s, _) in got if at == 1)
    first2 = min(s for (at, s, _) in got if at == 2)
    resumed = min(r["occurred_at"].timestamp() for (at, _, _), r in got.items() if at == 2)
    print(
        f"\nkilled after step {last1}; resumed shrunk at step {first2}, {resumed - killed:.2f}s after the kill"
    )
    assert KILL_AT <= first2 <= last1 + 1 and last1 + 1 - first2 <= MEMORY_EVERY + 1, (last1, first2)
    assert {(s, rank) for (at, s, rank) in got if at == 2} == {(s, 0) for s in range(first2, STEPS)}
    for (at, s, rank), r in got.items():
        expected = ref[(s, rank)] if at == 1 else (ref[(s, 0)] + ref[(s, 1)]) / 2
        assert r["loss"] == pytest.approx(expected, rel=1e-4), (at, s, rank)
