"""A hot spare (issue 40 §1) on three hosts (network namespaces): with `VIGIL_HOT_SPARES=1` hostc is held in
reserve and shown so; a 2-node job runs on hosta and hostb, and a 1-node job queued behind it is not
placed on the spare. Host b is cut off (then its worker and rank killed): the job is relaunched at once on hosta and
the spare, ahead of the queued job, and SUCCEEDS; once it ends the reserve refills and the queued job runs."""

from __future__ import annotations

from typing import Any

import pytest

from tests.integration.scheduler.conftest import launched, next_event, wait_state
from tests.integration.worker.conftest import tiny_spec
from vigil.events import CheckpointSaved, IncidentRaised
from vigil_common import subjects

from .conftest import Plane, Workers, unique, wait_alive
from .netns import Network

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.multihost]

HOSTS = ["a", "b", "c"]
PLANE = {"hot_spares": 1}


def spec(name: str, nodes: int, **train: Any) -> dict[str, Any]:
    s = tiny_spec(**train)
    s["name"] = unique(name)
    s["resources"] = {"nodes": nodes, "gpus_per_node": 1}
    return s


async def spares(plane: Plane) -> list[str]:
    items = (await plane.http.get("/api/v1/nodes")).json()["items"]
    return [n["name"] for n in items if n["spare"]]


async def test_a_job_that_loses_a_node_is_relaunched_on_the_spare_ahead_of_the_queue(
    plane: Plane, workers: Workers, network: Network
) -> None:
    a, b, c = network.hosts
    wa, wb, wc = workers.start(a), workers.start(b), workers.start(c)
    await wait_alive(plane, workers, wa.node, wb.node, wc.node)
    assert await spares(plane) == [wc.node]  # the last whole free node by name

    job_id = await plane.submit(spec("mh-spare", 2, steps=16, checkpoint={"every": 4}))
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

    # the job's nodes are free again: hostc is the spare again, and the queued job runs on hosta
    third = await launched(plane.bus, queued, timeout_s=60)
    assert [p.node for p in third.placement] == [wa.node]
    await wait_state(plane.bus, queued, "SUCCEEDED", timeout_s=240)
    assert await spares(plane) == [wc.node]
