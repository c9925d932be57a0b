"""The gateway's contract: auth, errors as JSON, spec as JSON or YAML, pages, OpenAPI, events."""

from __future__ import annotations

import asyncio
import base64
import itertools
import json

import httpx
import pytest

from vigil.events import IncidentRaised
from vigil_common import subjects
from vigil_common.bus import Bus
from vigil_scheduler.main import run

from .conftest import TOKEN, scheduler_settings, spec, wait_ready, wait_state

pytestmark = pytest.mark.integration


async def test_auth_on_api_only(scheduler) -> None:
    async with httpx.AsyncClient(base_url=scheduler.base_url) as anon:
        for path in ("/healthz", "/readyz", "/schema/openapi.json"):
            assert (await anon.get(path)).status_code == 200, path
        r = await anon.get("/api/v1/jobs")
        assert r.status_code == 401 and r.headers["www-authenticate"] == "Bearer"
        assert r.json()["error"] == "Unauthorized"
        assert (await anon.post("/api/v1/jobs", json=spec())).status_code == 401
        wrong = await anon.get("/api/v1/jobs", headers={"Authorization": "Bearer " + "x" * len(TOKEN)})
        assert wrong.status_code == 401 and wrong.json()["message"] == "invalid bearer token"
        basic = await anon.get("/api/v1/nodes", headers={"Authorization": f"Basic {TOKEN}"})
        assert basic.status_code == 401
    schema = (await scheduler.http.get("/schema/openapi.json")).json()
    paths = set(schema["paths"])
    for path in (
        "/api/v1/jobs",
        "/api/v1/jobs/{job_id}",
        "/api/v1/jobs/{job_id}/cancel",
        "/api/v1/jobs/{job_id}/steps",
        "/api/v1/jobs/{job_id}/checkpoints",
        "/api/v1/jobs/{job_id}/incidents",
        "/api/v1/incidents",
        "/api/v1/nodes",
        "/api/v1/gpus",
        "/api/v1/events",
    ):
        assert path in paths, path
    body = schema["paths"]["/api/v1/jobs"]["post"]["requestBody"]["content"]
    assert {"application/json", "application/yaml"} <= set(body)


async def test_bad_specs_are_422_naming_each_field(scheduler) -> None:
    bad = spec(train={"steps": 10, "lr": -1}, colour="red")
    r = await scheduler.http.post("/api/v1/jobs", json=bad)
    assert r.status_code == 422
    fields = {f["field"]: f["message"] for f in r.json()["fields"]}
    assert "train.lr" in fields and fields["colour"] == "unknown field"

    r = await scheduler.http.post(
        "/api/v1/jobs", content=b"name: [unclosed", headers={"Content-Type": "application/yaml"}
    )
    assert r.status_code == 422 and r.json()["fields"][0]["field"] == "(spec)"

    r = await scheduler.http.post("/api/v1/jobs", json=spec(faults=[{"kind": "nan", "step": 1, "rank": 9}]))
    assert r.status_code == 422 and r.json()["fields"][0]["field"] == "faults.0.rank"

    r = await scheduler.http.post(
        "/api/v1/jobs", json=spec(guardian={"hang_timeout_s": 10, "hang_floor_s": 30})
    )
    assert r.status_code == 422 and r.json()["fields"][0]["field"] == "guardian.hang_floor_s", r.text
    assert "exceeds guardian.hang_timeout_s" in r.json()["fields"][0]["message"]

    r = await scheduler.http.get("/api/v1/jobs", params={"limit": 0})
    assert r.status_code == 422 and r.json()["fields"][0]["field"] == "limit"
    r = await scheduler.http.get("/api/v1/jobs", params={"cursor": "!!"})
    assert r.status_code == 422 and r.json()["fields"][0]["field"] == "cursor"


async def test_yaml_body_and_body_limit(scheduler) -> None:
    yaml_spec = "name: from-yaml\npriority: 3\nresources: {nodes: 1, gpus_per_node: 1}\ntrain: {steps: 5}\n"
    r = await scheduler.http.post(
        "/api/v1/jobs", content=yaml_spec, headers={"Content-Type": "application/yaml"}
    )
    assert r.status_code == 201, r.text
    assert r.json()["name"] == "from-yaml" and r.json()["spec"]["priority"] == 3

    huge = json.dumps(spec(data={"path": "x" * (scheduler.settings.max_body_bytes + 10)}))
    r = await scheduler.http.post("/api/v1/jobs", content=huge, headers={"Content-Type": "application/json"})
    assert r.status_code == 413 and r.json()["status"] == 413


async def test_unknown_job_is_404_and_lists_are_pages(scheduler) -> None:
    for path in (
        "/api/v1/jobs/j-nope",
        "/api/v1/jobs/j-nope/steps",
        "/api/v1/jobs/j-nope/checkpoints",
        "/api/v1/jobs/j-nope/incidents",
    ):
        r = await scheduler.http.get(path)
        assert r.status_code == 404 and "j-nope" in r.json()["message"], path
    assert (await scheduler.http.post("/api/v1/jobs/j-nope/cancel")).status_code == 404

    ids = [
        (await scheduler.http.post("/api/v1/jobs", json=spec(f"p{i}", per_node=64))).json()["id"]
        for i in range(3)
    ]
    first = (await scheduler.http.get("/api/v1/jobs", params={"limit": 2})).json()
    assert [j["id"] for j in first["items"]] == ids[::-1][:2] and first["next"]
    second = (await scheduler.http.get("/api/v1/jobs", params={"limit": 2, "cursor": first["next"]})).json()
    assert [j["id"] for j in second["items"]] == [ids[0]] and second["next"] is None
    pending = (await scheduler.http.get("/api/v1/jobs", params={"state": "PENDING"})).json()["items"]
    assert {j["id"] for j in pending} == set(ids)
    for path in (
        "/api/v1/nodes",
        "/api/v1/gpus",
        "/api/v1/incidents",
        f"/api/v1/jobs/{ids[0]}/steps",
        f"/api/v1/jobs/{ids[0]}/checkpoints",
        f"/api/v1/jobs/{ids[0]}/incidents",
    ):
        page = (await scheduler.http.get(path)).json()
        assert set(page) == {"items", "next"}, path


def _cursor(key: object) -> str:
    """A well-formed cursor (base64 JSON, as the server makes them) holding `key`."""
    return base64.urlsafe_b64encode(json.dumps(key).encode()).decode().rstrip("=")


def _bad_cursors(good: str) -> list[str]:
    """Garbage, and cursors shaped like `good` but with the wrong arity or a part of the wrong type."""
    key = json.loads(base64.urlsafe_b64decode(good + "=" * (-len(good) % 4)))
    out = ["!!", "x" * 5000, _cursor({"seq": 1}), _cursor("x"), _cursor(None), _cursor([])]
    out += [_cursor(key + key[-1:]), _cursor(key[:-1]), _cursor([[1]])]
    out += [_cursor(k) for k in (["x"], [1, 2]) if [type(p) for p in k] != [type(p) for p in key]]
    for i, part in enumerate(key):
        wrong: list[object] = ["x", 1.5, True, None, 2**70] if isinstance(part, int) else [1, None, "a\x00b"]
        out += [_cursor([*key[:i], w, *key[i + 1 :]]) for w in wrong]
    return [c for c in out if c != good]


async def test_every_bad_cursor_is_422_naming_the_cursor(scheduler, nodes, bus: Bus) -> None:
    for node in (nodes(slots=2), nodes(slots=2)):
        await node.beat()
    ids = [
        (await scheduler.http.post("/api/v1/jobs", json=spec(f"c{i}", per_node=64))).json()["id"]
        for i in range(2)
    ]
    job = ids[0]
    for step, rank in itertools.product((1, 2), (0, 1)):
        await scheduler.pool.execute(
            """INSERT INTO telemetry_steps (event_id, job_id, attempt, step, rank, node, loss, lr, tokens,
                   tokens_per_s, data_time_s, forward_time_s, backward_time_s, comm_time_s, optimizer_time_s,
                   step_time_s, skipped, data_position, occurred_at)
               VALUES ($1, $2, 1, $3::int, $4, 'n', 2.0, 0.1, 10, 5.0, 0, 0, 0, 0, 0, 1.0, false, $3::bigint, now())""",
            f"s-{step}-{rank}",
            job,
            step,
            rank,
        )
    for step in (1, 2):
        await scheduler.pool.execute(
            """INSERT INTO telemetry_checkpoints (job_id, step, path, attempt, bytes, manifest_sha256,
                   data_position, event_id, created_at) VALUES ($1, $2::int, $3, 1, 10, 'x', $2::bigint, $3, now())""",
            job,
            step,
            f"/ckpt/{step}",
        )
        await scheduler.pool.execute(
            """INSERT INTO telemetry_incidents (id, job_id, attempt, kind, action, message, evidence, occurred_at)
               VALUES ($1, $2, 1, 'spike', 'alert', 'm', '{}', now())""",
            f"inc-{step}",
            job,
        )
    await eventually_listed(scheduler, "/api/v1/gpus", 4)
    lists = [
        ("/api/v1/jobs", {}),
        ("/api/v1/nodes", {}),
        ("/api/v1/gpus", {}),
        ("/api/v1/incidents", {}),
        (f"/api/v1/jobs/{job}/incidents", {}),
        (f"/api/v1/jobs/{job}/steps", {}),
        (f"/api/v1/jobs/{job}/steps", {"rank": 0}),
        (f"/api/v1/jobs/{job}/steps", {"aggregate": "true"}),
        (f"/api/v1/jobs/{job}/checkpoints", {}),
    ]
    for path, params in lists:
        first = (await scheduler.http.get(path, params={**params, "limit": 1})).json()
        good = first["next"]
        assert good, (path, params)
        second = await scheduler.http.get(path, params={**params, "limit": 1, "cursor": good})
        assert second.status_code == 200 and second.json()["items"] != first["items"], (path, params)
        # an empty cursor (`?cursor=`, as a client filling it in from a missing `next` sends it) is the
        # first page, as no cursor is: the same item (a page of one: its `next` is that item's sort key;
        # the item's own fields may have moved on, a node's heartbeat, a job placed, since)
        empty = await scheduler.http.get(path, params={**params, "limit": 1, "cursor": ""})
        assert empty.status_code == 200 and empty.json()["next"] == good, (path, params, empty.text)
        assert len(empty.json()["items"]) == 1, (path, params, empty.text)
        for bad in _bad_cursors(good):
            r = await scheduler.http.get(path, params={**params, "cursor": bad})
            assert r.status_code == 422, (path, params, bad, r.status_code, r.text)
            assert [f["field"] for f in r.json()["fields"]] == ["cursor"], (path, params, bad, r.text)


async def eventually_listed(scheduler, path: str, n: int, timeout_s: float = 10.0) -> None:
    """Wait until `path` lists at least `n` items (heartbeats are consumed asynchronously)."""
    deadline = asyncio.get_running_loop().time() + timeout_s
    while len((await scheduler.http.get(path)).json()["items"]) < n:
        assert asyncio.get_running_loop().time() < deadline, f"{path} never listed {n} items"
        await asyncio.sleep(0.05)  # polling the API


async def test_job_shows_progress_from_telemetry(scheduler) -> None:
    job = (await scheduler.http.post("/api/v1/jobs", json=spec(per_node=64))).json()
    await scheduler.pool.execute(
        """INSERT INTO telemetry_job_progress (job_id, attempt, last_step, loss, occurred_at)
           VALUES ($1, 1, 41, 'NaN', now())""",
        job["id"],
    )
    got = (await scheduler.http.get(f"/api/v1/jobs/{job['id']}")).json()
    assert got["last_step"] == 41 and got["loss"] is None  # NaN has no JSON number
    await scheduler.pool.execute("UPDATE telemetry_job_progress SET loss = 2.5 WHERE job_id = $1", job["id"])
    listed = (await scheduler.http.get("/api/v1/jobs")).json()["items"][0]
    assert listed["id"] == job["id"] and listed["loss"] == 2.5


async def test_events_stream_state_changes_and_incidents(scheduler, nodes, bus: Bus) -> None:
    node = nodes(slots=1)
    await node.beat()
    headers = {"Authorization": f"Bearer {TOKEN}"}
    received: list[tuple[str, dict]] = []
    connected = asyncio.Event()

    async def listen() -> None:
        async with (
            httpx.AsyncClient(base_url=scheduler.base_url, timeout=30) as http,
            http.stream("GET", "/api/v1/events", headers=headers) as r,
        ):
            assert r.status_code == 200
            assert r.headers["content-type"].startswith("text/event-stream")
            event = None
            async for line in r.aiter_lines():
                if line.startswith(": connected"):
                    connected.set()
                elif line.startswith("event: "):
                    event = line.removeprefix("event: ")
                elif line.startswith("data: ") and event:
                    received.append((event, json.loads(line.removeprefix("data: "))))
                    if event == "incident.raised":
                        return

    listener = asyncio.create_task(listen())
    await asyncio.wait_for(connected.wait(), 10)
    job = (await scheduler.http.post("/api/v1/jobs", json=spec(per_node=1))).json()
    await wait_state(bus, job["id"], "SCHEDULED")
    await bus.publish(
        subjects.incident(job["id"]),
        IncidentRaised(job_id=job["id"], attempt=1, kind="straggler", action="alert", message="slow rank 0"),
    )
    await asyncio.wait_for(listener, 15)
    states = [d["to_state"] for e, d in received if e == "job.state_changed" and d["job_id"] == job["id"]]
    assert states == ["PENDING", "SCHEDULED"]
    assert received[-1][1]["message"] == "slow rank 0"


async def test_stopping_ends_open_event_streams(db_url: str, nats_url: str, tmp_path) -> None:
    settings = scheduler_settings(db_url, nats_url, tmp_path)
    stop = asyncio.Event()
    service = asyncio.create_task(run(settings, stop))
    base = f"http://127.0.0.1:{settings.http_port}"
    await wait_ready(base, task=service)
    connected = asyncio.Event()

    async def listen() -> str:
        async with (
            httpx.AsyncClient(base_url=base, timeout=30) as http,
            http.stream("GET", "/api/v1/events", headers={"Authorization": f"Bearer {TOKEN}"}) as r,
        ):
            async for line in r.aiter_lines():
                if line.startswith(": connected"):
                    connected.set()
        return "ended"

    listener = asyncio.create_task(listen())
    await asyncio.wait_for(connected.wait(), 10)
    stop.set()
    await asyncio.wait_for(service, 20)
    # a clean end of the stream: had the gateway waited for its graceful-shutdown timeout (3 s), it would
    # then have cut the connection, and the listener would raise (an incomplete chunked read), not end
    assert await asyncio.wait_for(listener, 5) == "ended"
