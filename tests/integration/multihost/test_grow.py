"""An elastic job on two hosts (network namespaces) shrinks and grows back (issue 40 §3): host b dies (its
worker and rank SIGKILLed) mid-run, and the job goes on with hosta alone; then a worker starts on host b
again, and at the job's next checkpoint boundary it grows back to both hosts: the shrunk attempt ends, the
next resumes at 2 ranks from that checkpoint (or a newer in-memory snapshot), re-partitioned. Every loss
of the grown attempt is the fault-free run's, rank by rank, and the job SUCCEEDS at 2 ranks."""

from __future__ import annotations

import time
from typing import Any

import pytest

from tests.integration.scheduler.conftest import launched, next_event, wait_state
from tests.integration.worker.conftest import tiny_spec
from vigil_bench.netns import Network
from vigil_common import subjects

from .conftest import Plane, Workers, stored_steps, unique, wait_alive

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.multihost]

HOSTS = ["a", "b"]
PLANE = {"node_lost_after": 20}  # silence ends a node after 10 s: the kill is known sooner
KILL_AT, EVERY, MEMORY_EVERY, STEPS = 8, 4, 1, 40


def spec(name: str) -> dict[str, Any]:
    s = tiny_spec(steps=STEPS, checkpoint={"every": EVERY, "memory_every": MEMORY_EVERY})
    s["name"] = unique(name)
    s["resources"] = {"nodes": 2, "gpus_per_node": 1, "elastic": {"min_nodes": 1}}
    return s


async def test_an_elastic_job_grows_back_to_both_hosts_at_its_next_checkpoint(
    plane: Plane, workers: Workers, network: Network
) -> None:
    a, b = network.hosts
    wa, wb = workers.start(a), workers.start(b)
    await wait_alive(plane, workers, wa.node, wb.node)
    reference = await plane.submit(spec("mh-grow-reference"))
    await wait_state(plane.bus, reference, "SUCCEEDED", timeout_s=240)

    body = spec("mh-grow")
    # the shrunk attempt trains slowly (0.5 s more a step, from step 13: after the kill, once), so that it
    # is still training when host b's new worker is up: beside `stress --cpu 2` that worker took longer
    # than the 30 shrunk steps of 0.2 s, the job finished shrunk and nothing grew. Losses are unchanged.
    body["faults"] = [{"kind": "slow_rank", "step": 13, "rank": 0, "delay_s": 0.5}]
    job_id = await plane.submit(body)
    first = await launched(plane.bus, job_id, timeout_s=30)
    await next_event(
        plane.bus, subjects.step(job_id, wb.node), lambda e: getattr(e, "step", -1) >= KILL_AT, timeout_s=180
    )
    workers.kill(b)
    shrunk = await launched(plane.bus, job_id, attempt=2, timeout_s=30)
    assert [(p.rank, p.node) for p in shrunk.placement] == [(0, wa.node)]
    await next_event(  # it trains shrunk before the capacity comes back
        plane.bus, subjects.step(job_id, wa.node), lambda e: getattr(e, "attempt", 0) == 2, timeout_s=120
    )

    workers.start(b)  # host b is back, with a new worker
    returned = time.time()
    ended = await wait_state(plane.bus, job_id, "ROLLING_BACK", attempt=3, timeout_s=120)
    assert ended.cause.startswith("grow back to 2 nodes (capacity returned): attempt 3 resumes at 2 ranks")
    grown = await launched(plane.bus, job_id, attempt=3, timeout_s=30)
    assert sorted(p.node for p in grown.placement) == sorted([wa.node, wb.node]) and grown.world_size == 2
    scheduled = await wait_state(plane.bus, job_id, "SCHEDULED", attempt=3)
    assert "grew back to 2 of 2 nodes (capacity returned; 2 ranks)" in scheduled.cause
    await wait_state(plane.bus, job_id, "SUCCEEDED", timeout_s=240)

    ref, got = await stored_steps(plane, reference, job_id)
    last2 = max(s for (at, s, _) in got if at == 2)
    first3 = min(s for (at, s, _) in got if at == 3)
    whole = min(r["occurred_at"].timestamp() for (at, _, _), r in got.items() if at == 3)
    cold = min(r["occurred_at"].timestamp() for (at, _, _), r in got.items() if at == 1)
    cold -= first.occurred_at.timestamp()
    shrunk_steps = sorted(r["occurred_at"].timestamp() for (at, _, _), r in got.items() if at == 2)
    print(
        f"\nshrunk until step {last2}; grew back at step {first3} ({last2 + 1 - first3} steps redone),"
        f" {whole - returned:.2f}s after host b's worker started: grow decided at"
        f" {ended.occurred_at.timestamp() - returned:.2f}s, launched at {grown.occurred_at.timestamp() - returned:.2f}s;"
        f" shrunk steps {(shrunk_steps[-1] - shrunk_steps[0]) / max(1, len(shrunk_steps) - 1):.2f}s each,"
        f" the last at {shrunk_steps[-1] - returned:.2f}s; a cold launch (attempt 1) took {cold:.2f}s to its"
        " first step"
    )
    assert first3 <= last2 + 1, (last2, first3)
    assert {(s, rank) for (at, s, rank) in got if at == 3} == {
        (s, r) for s in range(first3, STEPS) for r in (0, 1)
    }
    for (at, s, rank), r in got.items():
        expected = (ref[(s, 0)] + ref[(s, 1)]) / 2 if at == 2 else ref[(s, rank)]
        assert r["loss"] == pytest.approx(expected, rel=1e-4), (at, s, rank)
