"""Backfill, fair share and the queue in words against the real scheduler, Postgres and NATS: a short job
starts behind a blocked head and a job without a time limit waits; the queue (and a job's detail) says
why, with the reservation's time; a team that used its share waits behind one that did not."""

from __future__ import annotations

import asyncio
import json
import time
from datetime import datetime

import pytest
from click.testing import CliRunner, Result

from tests.helpers import eventually
from vigil_cli.main import cli
from vigil_common.bus import Bus
from vigil_scheduler import queueview

from .conftest import TOKEN, launched, spec, start_ranks, wait_state

pytestmark = pytest.mark.integration


async def vigil(scheduler, *args: str) -> Result:
    env = {"VIGIL_API_TOKEN": TOKEN, "VIGIL_HTTP_PORT": str(scheduler.settings.http_port), "COLUMNS": "200"}
    return await asyncio.to_thread(CliRunner().invoke, cli, list(args), env=env)  # the CLI is synchronous


async def test_a_short_job_backfills_behind_the_reserved_head_and_the_queue_says_why(
    scheduler, nodes, bus: Bus
) -> None:
    node = nodes(slots=6)
    await node.beat()
    submit = scheduler.http.post
    running = (await submit("/api/v1/jobs", json=spec("a", scheduling={"time_limit": "1h"}))).json()["id"]
    await launched(bus, running)
    head = (await submit("/api/v1/jobs", json=spec("head", per_node=6, priority=5))).json()["id"]
    endless = (await submit("/api/v1/jobs", json=spec("endless"))).json()["id"]
    short = (await submit("/api/v1/jobs", json=spec("short", scheduling={"time_limit": "10m"}))).json()["id"]
    await launched(bus, short)  # it ends before the head's reservation (a's limit): it starts now

    asked_at = time.time()
    queue = (await scheduler.http.get("/api/v1/queue")).json()
    answered_at = time.time()
    assert [(e["id"], e["position"]) for e in queue["items"]] == [(head, 1), (endless, 2)]
    first, second = queue["items"]
    placed_at = await scheduler.pool.fetchval(
        "SELECT occurred_at FROM job_transitions WHERE job_id = $1 AND to_state = 'SCHEDULED'", running
    )
    reserved = datetime.fromisoformat(first["estimated_start"])
    assert first["reserved"] and abs(reserved.timestamp() - placed_at.timestamp() - 3600) < 0.01
    # "00:28 UTC" today, with the date on another day: the gateway's clock is read between the two
    at = first["reason"].rpartition(" from ")[2]
    assert at in {queueview.at(reserved.timestamp(), now) for now in (asked_at, answered_at)}, first["reason"]
    assert first["reason"] == f"needs 6 GPUs on one node; reserved for {head} from {at}"
    assert second["reason"] == (
        f"behind {head}, which is reserved from {at}; it has no time limit and needs devices the reservation holds"
    )
    assert second["estimated_start"] is None  # behind a head without a time limit: no end is known
    detail = (await scheduler.http.get(f"/api/v1/jobs/{head}")).json()
    assert detail["state"] == "PENDING" and detail["queue"]["reason"] == first["reason"]
    assert (await scheduler.http.get(f"/api/v1/jobs/{short}")).json()["queue"] is None
    shown = await vigil(scheduler, "job", head)
    assert shown.exit_code == 0 and "queue: position 1, estimated start" in shown.output, shown.output
    page = await scheduler.http.get("/queue")  # the console's page
    assert page.status_code == 200 and first["reason"] in page.text and endless in page.text
    page = await scheduler.http.get(f"/jobs/{head}")  # and the job's page
    assert (
        page.status_code == 200
        and f"queue position 1, estimated start {reserved:%Y-%m-%d %H:%M} UTC" in page.text
    )

    # a job being stopped (a preemption's victim) frees its devices within the grace period, not at its limit
    asked = await scheduler.pool.fetchval(
        """INSERT INTO job_stops (job_id, attempt, kind, reason) VALUES ($1, 1, 'preempt', 'for a test')
           RETURNING requested_at""",
        running,
    )
    first = (await scheduler.http.get("/api/v1/queue")).json()["items"][0]
    grace = scheduler.settings.preemption_grace_s
    assert datetime.fromisoformat(first["estimated_start"]).timestamp() == pytest.approx(
        asked.timestamp() + grace
    )


async def test_equal_priorities_go_to_the_team_below_its_share_first(
    scheduler, as_user, nodes, bus: Bus
) -> None:
    refused = await scheduler.http.put("/api/v1/teams/vision/share", json={"share": 0})
    assert refused.status_code == 422 and "share" in refused.text
    done = await vigil(scheduler, "teams", "set-share", "vision", "2")
    assert done.exit_code == 0 and done.output.strip() == "team vision: share 2", done.output
    teams = (await scheduler.http.get("/api/v1/teams")).json()["items"]
    assert [(t["name"], t["share"]) for t in teams] == [("vision", 2.0)]
    node = nodes(slots=2)
    await node.beat()
    alice, bob, carol = (
        await as_user("alice", "vision"),
        await as_user("bob", "vision"),
        await as_user("carol", "nlp"),
    )
    used = (await alice.post("/api/v1/jobs", json=spec("used"))).json()["id"]
    await start_ranks(bus, await launched(bus, used))
    await wait_state(bus, used, "RUNNING")  # vision's GPU-hours grow from its ranks' start
    vision = (await bob.post("/api/v1/jobs", json=spec("vision-next"))).json()["id"]
    nlp = (await carol.post("/api/v1/jobs", json=spec("nlp-next"))).json()["id"]

    async def ordered() -> list[dict] | None:
        items = (await scheduler.http.get("/api/v1/queue")).json()["items"]
        return items if [e["id"] for e in items] == [nlp, vision] else None

    items = await eventually(ordered, what="nlp's job ahead of vision's, submitted earlier")
    assert items[1]["reason"].endswith("team vision over its share (1.5x)")  # shares 2:1, all usage vision's
    # a user sees their team's jobs, each at its place in the whole queue
    assert [(e["id"], e["position"]) for e in (await bob.get("/api/v1/queue")).json()["items"]] == [
        (vision, 2)
    ]
    assert [e["id"] for e in (await carol.get("/api/v1/queue")).json()["items"]] == [nlp]
    shown = await vigil(scheduler, "queue", "--json")
    assert shown.exit_code == 0, shown.output
    standing = {t["team"]: t for t in json.loads(shown.output)["teams"]}
    table = await vigil(scheduler, "queue")
    assert "team vision over its share (1.5x)" in table.output and nlp in table.output
    assert standing["vision"]["ratio"] == pytest.approx(1.5) and standing["nlp"]["factor"] == 1.0
    assert (await alice.post(f"/api/v1/jobs/{used}/cancel")).status_code == 200
    await launched(bus, nlp)
    assert (await bob.get(f"/api/v1/jobs/{vision}")).json()["state"] == "PENDING"
