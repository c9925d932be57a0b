"""What another user's token gets for a job it may not see: the answers of a job that does not exist, on
every route that names a job, and nothing of it in lists, the audit record and the event stream."""

from __future__ import annotations

import httpx

JOB_ROUTES = ("", "/steps", "/checkpoints", "/incidents")


async def assert_hidden(client: httpx.AsyncClient, job_id: str) -> None:
    """`client` reads, follows, lists and cancels the job exactly as if it did not exist."""
    missing = job_id + "-none"  # an id no job has: the answers must be the same
    for suffix in JOB_ROUTES:
        theirs = await client.get(f"/api/v1/jobs/{job_id}{suffix}")
        none = await client.get(f"/api/v1/jobs/{missing}{suffix}")
        assert theirs.status_code == none.status_code == 404, (suffix, theirs.text)
        assert theirs.json()["message"] == none.json()["message"].replace(missing, job_id), suffix
    for path in (f"/api/v1/jobs/{job_id}/cancel", f"/api/v1/jobs/{missing}/cancel"):
        r = await client.post(path)
        assert r.status_code == 404 and r.json()["error"] == "NotFound", r.text
    r = await client.get("/api/v1/events", params={"job": job_id})
    assert r.status_code == 404, r.text
    listed = (await client.get("/api/v1/jobs", params={"limit": 1000})).json()["items"]
    assert job_id not in {j["id"] for j in listed}
    audited = (await client.get("/api/v1/audit", params={"job_id": job_id})).json()["items"]
    assert audited == []
    everything = (await client.get("/api/v1/audit", params={"limit": 1000})).json()["items"]
    assert job_id not in {a["job_id"] for a in everything}


async def assert_visible(client: httpx.AsyncClient, job_id: str) -> None:
    for suffix in JOB_ROUTES:
        r = await client.get(f"/api/v1/jobs/{job_id}{suffix}")
        assert r.status_code == 200, (suffix, r.text)
    listed = (await client.get("/api/v1/jobs", params={"limit": 1000})).json()["items"]
    assert job_id in {j["id"] for j in listed}
