"""Submit through the gateway; the scheduler places the job and launches it on the bus."""

from __future__ import annotations

import pytest

from vigil.events import CancelJob, LaunchJob
from vigil_common import subjects
from vigil_common.bus import Bus

from .conftest import count_on, next_event, spec, wait_state

pytestmark = pytest.mark.integration


async def test_submit_launches_with_the_placement(scheduler, nodes, bus: Bus) -> None:
    node = nodes(slots=2, address="10.0.0.7")
    await node.beat()
    r = await scheduler.http.post("/api/v1/jobs", json=spec("first"))
    assert r.status_code == 201, r.text
    job = r.json()
    assert job["id"].startswith("j-") and job["state"] == "PENDING" and job["attempt"] == 1

    launch = await next_event(bus, subjects.launch(job["id"]), lambda e: isinstance(e, LaunchJob))
    assert isinstance(launch, LaunchJob)
    assert launch.attempt == 1 and launch.world_size == 2
    assert [(p.rank, p.node, p.device, p.local_rank) for p in launch.placement] == [
        (0, node.name, 0, 0),
        (1, node.name, 1, 1),
    ]
    assert launch.master_addr == "10.0.0.7" and launch.resume_from is None
    await wait_state(bus, job["id"], "SCHEDULED")

    got = (await scheduler.http.get(f"/api/v1/jobs/{job['id']}")).json()
    assert got["state"] == "SCHEDULED"
    assert [t["to_state"] for t in got["transitions"]] == ["PENDING", "SCHEDULED"]
    assert all(t["cause"] for t in got["transitions"])
    assert await count_on(bus, subjects.JOBS.name, subjects.launch(job["id"])) == 1


async def test_second_job_waits_until_cancel_frees_the_devices(scheduler, nodes, bus: Bus) -> None:
    node = nodes(slots=2)
    await node.beat()
    first = (await scheduler.http.post("/api/v1/jobs", json=spec("a"))).json()
    await wait_state(bus, first["id"], "SCHEDULED")
    second = (await scheduler.http.post("/api/v1/jobs", json=spec("b"))).json()

    gpus = (await scheduler.http.get("/api/v1/gpus")).json()["items"]
    assert {g["job_id"] for g in gpus if g["node"] == node.name} == {first["id"]}
    assert (await scheduler.http.get(f"/api/v1/jobs/{second['id']}")).json()["state"] == "PENDING"

    r = await scheduler.http.post(f"/api/v1/jobs/{first['id']}/cancel")
    assert r.status_code == 200 and r.json()["state"] == "CANCELLED"
    cancel = await next_event(bus, subjects.cmd(first["id"]), lambda e: isinstance(e, CancelJob))
    assert cancel.attempt == 1

    launch = await next_event(bus, subjects.launch(second["id"]), lambda e: isinstance(e, LaunchJob))
    assert {p.node for p in launch.placement} == {node.name}
    gpus = (await scheduler.http.get("/api/v1/gpus")).json()["items"]
    assert {g["job_id"] for g in gpus if g["node"] == node.name} == {second["id"]}

    again = await scheduler.http.post(f"/api/v1/jobs/{first['id']}/cancel")
    assert again.status_code == 409
    assert "CANCELLED" in again.json()["message"]
