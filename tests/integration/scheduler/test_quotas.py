"""GPU quotas against the real gateway and placement: a job bigger than its owner's or team's quota is a
422 naming the quota; a job that would take its team past its quota waits PENDING with the reason (in
the API and the console) while other teams' jobs are placed, and runs once its team's job ends."""

from __future__ import annotations

import pytest

from tests.helpers import eventually
from vigil_common.bus import Bus

from .conftest import launched, spec, wait_state

pytestmark = pytest.mark.integration


async def test_a_job_bigger_than_its_quota_is_refused_naming_the_quota(scheduler, as_user) -> None:
    assert (await scheduler.http.put("/api/v1/teams/vision", json={"gpus": 3})).status_code == 200
    alice = await as_user("alice", "vision", gpus=8)
    carol = await as_user("carol", "nlp", gpus=1)
    for client, wanted, quota in (
        (alice, spec(per_node=4), "team vision's quota of 3"),
        (carol, spec(per_node=2), "user carol's quota of 1"),
    ):
        r = await client.post("/api/v1/jobs", json=wanted)
        assert r.status_code == 422, r.text
        assert r.json()["fields"][0]["field"] == "resources" and quota in r.json()["fields"][0]["message"]
    assert (await scheduler.http.get("/api/v1/jobs")).json()["items"] == []  # nothing was stored
    r = await alice.post("/api/v1/jobs", json=spec(per_node=3))  # exactly the quota: accepted
    assert r.status_code == 201, r.text


async def test_a_job_past_its_teams_quota_waits_with_the_reason_and_others_go_ahead(
    scheduler, as_user, nodes, bus: Bus
) -> None:
    node = nodes(slots=6)
    await node.beat()
    assert (await scheduler.http.put("/api/v1/teams/vision", json={"gpus": 3})).status_code == 200
    alice = await as_user("alice", "vision")
    bob = await as_user("bob", "vision")
    carol = await as_user("carol", "nlp")
    first = (await alice.post("/api/v1/jobs", json=spec(per_node=2))).json()["id"]
    await launched(bus, first)
    waiting = (await bob.post("/api/v1/jobs", json=spec(per_node=2, priority=10))).json()["id"]

    async def reason() -> str | None:
        return (await bob.get(f"/api/v1/jobs/{waiting}")).json()["queue_reason"]

    why = await eventually(reason, what="the quota's queue reason")
    assert why == "quota: team vision uses 2 of 3 GPUs; this job needs 2"
    # the waiting job (priority 10) holds up no other team's job: carol's is placed on the free devices
    other = (await carol.post("/api/v1/jobs", json=spec(per_node=2))).json()["id"]
    await launched(bus, other)
    # the inventory shows carol her own job's devices, and alice's as busy without naming the job
    for path in ("/api/v1/gpus", "/api/v1/nodes"):
        body = (await carol.get(path)).json()["items"]
        devices = body if path.endswith("gpus") else [d for n in body for d in n["devices"]]
        assert {d["job_id"] for d in devices} == {other, "(another user's job)", None}, path
    assert first in {d["job_id"] for d in (await scheduler.http.get("/api/v1/gpus")).json()["items"]}
    job = (await bob.get(f"/api/v1/jobs/{waiting}")).json()
    assert job["state"] == "PENDING" and job["queue_reason"] == why
    page = await scheduler.http.get(f"/jobs/{waiting}")  # the console shows it too (the admin's token)
    assert page.status_code == 200 and why in page.text

    assert (await alice.post(f"/api/v1/jobs/{first}/cancel")).status_code == 200
    await wait_state(bus, waiting, "SCHEDULED")
    assert (await bob.get(f"/api/v1/jobs/{waiting}")).json()["queue_reason"] is None
