"""Users who own their jobs, against the real gateway: a user reads, follows, lists and cancels its own
jobs and its team's, another user's are a 404, an admin sees all; the audit record names the
authenticated principal; only an admin manages users; the file of users counts from the start."""

from __future__ import annotations

import asyncio
import contextlib
import json
from pathlib import Path

import httpx
import pytest

from tests.helpers import eventually
from vigil.events import HaltJob
from vigil_common import subjects
from vigil_common.bus import SENDER_HEADER, Bus
from vigil_scheduler.audit import token_actor
from vigil_scheduler.main import run
from vigil_scheduler.principals import new_token, token_sha256

from .conftest import TOKEN, scheduler_settings, spec, wait_ready
from .ownership import assert_hidden, assert_visible

pytestmark = pytest.mark.integration

NEVER_PLACED = spec(per_node=64)  # no node holds 64 devices: the job stays PENDING


async def test_a_user_sees_and_cancels_its_own_and_its_teams_jobs_only(scheduler, as_user) -> None:
    alice = await as_user("alice", "vision")
    bob = await as_user("bob", "vision")
    carol = await as_user("carol", "nlp")
    r = await alice.post("/api/v1/jobs", json=NEVER_PLACED)
    assert r.status_code == 201, r.text
    job = r.json()
    assert (job["owner"], job["team"]) == ("alice", "vision")

    await assert_hidden(carol, job["id"])  # another team: as if it did not exist
    assert (await alice.get(f"/api/v1/jobs/{job['id']}")).json()[
        "state"
    ] == "PENDING"  # carol's cancel did nothing
    for reader in (alice, bob, scheduler.http):  # the owner, the team, the admin
        await assert_visible(reader, job["id"])

    r = await bob.post(f"/api/v1/jobs/{job['id']}/cancel")  # the team may cancel it
    assert r.status_code == 200 and r.json()["state"] == "CANCELLED", r.text
    mine = (await carol.post("/api/v1/jobs", json=NEVER_PLACED)).json()
    assert [j["id"] for j in (await carol.get("/api/v1/jobs")).json()["items"]] == [mine["id"]]
    assert {j["id"] for j in (await scheduler.http.get("/api/v1/jobs")).json()["items"]} == {
        job["id"],
        mine["id"],
    }

    records = (await scheduler.http.get("/api/v1/audit", params={"job_id": job["id"]})).json()["items"]
    assert [(r["action"], r["actor"]) for r in records] == [("cancel", "user:bob"), ("submit", "user:alice")]
    me = (await carol.get("/api/v1/me")).json()
    assert me == {"name": "carol", "team": "nlp", "admin": False, "actor": "user:carol"}


async def test_a_users_event_stream_carries_only_the_jobs_it_may_see(scheduler, as_user) -> None:
    alice = await as_user("alice", "vision")
    carol = await as_user("carol", "nlp")
    theirs = (await alice.post("/api/v1/jobs", json=NEVER_PLACED)).json()["id"]
    seen: list[str] = []
    connected = asyncio.Event()

    async def follow() -> None:
        async with carol.stream("GET", "/api/v1/events", timeout=30) as r:
            assert r.status_code == 200
            async for line in r.aiter_lines():
                if line.startswith(": connected"):
                    connected.set()
                elif line.startswith("data: {"):
                    event = json.loads(line.removeprefix("data: "))
                    seen.append(event["job_id"])
                    if event.get("to_state") == "CANCELLED" and event["job_id"] != theirs:
                        return

    follower = asyncio.create_task(follow())
    await asyncio.wait_for(connected.wait(), 10)
    assert (await alice.post(f"/api/v1/jobs/{theirs}/cancel")).status_code == 200  # published first
    mine = (await carol.post("/api/v1/jobs", json=NEVER_PLACED)).json()["id"]
    assert (await carol.post(f"/api/v1/jobs/{mine}/cancel")).status_code == 200
    await asyncio.wait_for(follower, 15)
    assert seen == [mine, mine]  # PENDING, CANCELLED of its own; nothing of alice's


async def test_the_audit_actor_is_the_principal_never_a_name_the_client_chose(
    scheduler, as_user, nats_url: str
) -> None:
    alice = await as_user("alice")
    job = (await alice.post("/api/v1/jobs", json=NEVER_PLACED, headers={SENDER_HEADER: "root"})).json()["id"]
    # A command on the bus whose publisher names itself: the record says only a role that may publish
    # commands, never the free text.
    bus = await Bus.connect(nats_url, "mallory")  # the connection's name is its publications' header
    try:
        await bus.publish(subjects.cmd(job), HaltJob(job_id=job, attempt=1, reason="forged"))
    finally:
        await bus.close()

    async def recorded() -> list[tuple[str, str]]:
        items = (await scheduler.http.get("/api/v1/audit", params={"job_id": job})).json()["items"]
        return [(r["action"], r["actor"]) for r in items] if len(items) >= 2 else []

    assert await eventually(recorded, what="the halt's record") == [
        ("halt", "service:unverified"),
        ("submit", "user:alice"),
    ]
    assert (await scheduler.http.post(f"/api/v1/jobs/{job}/cancel")).status_code == 200
    records = (await alice.get("/api/v1/audit", params={"job_id": job})).json()["items"]
    assert records[0]["action"] == "cancel" and records[0]["actor"] == token_actor(TOKEN)


async def test_only_an_admin_manages_users_and_a_revoked_token_is_refused(scheduler, as_user) -> None:
    alice = await as_user("alice", "vision")
    for method, path, body in (
        ("GET", "/api/v1/users", None),
        ("PUT", "/api/v1/users/alice", {"admin": True}),
        ("POST", "/api/v1/users/alice/tokens", None),
        ("PUT", "/api/v1/teams/vision", {"gpus": 1000}),
    ):
        r = await alice.request(method, path, json=body)
        assert r.status_code == 403 and "admin" in r.json()["message"], (path, r.text)
    r = await scheduler.http.put("/api/v1/users/admin", json={})
    assert r.status_code == 422 and r.json()["fields"][0]["field"] == "name"
    r = await scheduler.http.put("/api/v1/users/Not%20A%20Name", json={})
    assert r.status_code == 422
    r = await scheduler.http.post("/api/v1/users/nobody/tokens")
    assert r.status_code == 404
    listed = (await scheduler.http.get("/api/v1/users")).json()["items"]
    assert [(u["name"], u["tokens"]) for u in listed] == [("alice", 1)]

    token = alice.headers["authorization"].removeprefix("Bearer ")
    stored = await scheduler.pool.fetch("SELECT sha256 FROM api_tokens")
    assert [r["sha256"] for r in stored] == [token_sha256(token)]  # the hash, never the token
    assert token not in str(await scheduler.pool.fetch("SELECT * FROM audit_log"))
    r = await scheduler.http.delete("/api/v1/users/alice/tokens")
    assert r.status_code == 200 and r.json() == {"user": "alice", "revoked": 1}
    assert (await alice.get("/api/v1/jobs")).status_code == 401


async def test_the_users_file_counts_from_the_start(db_url: str, nats_url: str, tmp_path: Path) -> None:
    token = new_token()
    users = tmp_path / "users.yaml"
    users.write_text(
        "users:\n"
        f"  - {{name: dana, team: vision, gpus: 1, token_sha256: {token_sha256(token)}}}\n"
        "teams:\n  - {name: vision, gpus: 8}\n  - {name: nlp, share: 3}\n"
    )
    settings = scheduler_settings(db_url, nats_url, tmp_path, users_file=users)
    stop = asyncio.Event()
    task = asyncio.create_task(run(settings, stop))
    base = f"http://{settings.http_host}:{settings.http_port}"
    try:
        await wait_ready(base, task=task)
        async with httpx.AsyncClient(base_url=base, headers={"Authorization": f"Bearer {token}"}) as dana:
            assert (await dana.get("/api/v1/me")).json()["name"] == "dana"
            r = await dana.post("/api/v1/jobs", json=spec(per_node=2))
            assert r.status_code == 422 and "user dana's quota of 1" in r.json()["fields"][0]["message"]
        async with httpx.AsyncClient(base_url=base, headers={"Authorization": f"Bearer {TOKEN}"}) as admin:
            teams = (await admin.get("/api/v1/teams")).json()["items"]
            assert [(t["name"], t["gpus"], t["share"]) for t in teams] == [
                ("nlp", None, 3.0),
                ("vision", 8, 1.0),
            ]
    finally:
        stop.set()
        with contextlib.suppress(Exception):
            await asyncio.wait_for(task, timeout=20)
