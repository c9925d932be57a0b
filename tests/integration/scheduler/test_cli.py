"""The CLI against a running gateway: tables for people, JSON for scripts, errors that say what is wrong."""

from __future__ import annotations

import asyncio
import json
import os
from pathlib import Path

import pytest
from click.testing import CliRunner, Result

from tests.helpers import eventually
from vigil_cli.main import cli
from vigil_common.bus import Bus

from .conftest import TOKEN, exit_rank, launched, start_ranks

pytestmark = pytest.mark.integration


async def vigil(scheduler, *args: str, token: str = TOKEN) -> Result:
    env = {"VIGIL_API_TOKEN": token, "VIGIL_HTTP_PORT": str(scheduler.settings.http_port), "COLUMNS": "200"}
    # The CLI is synchronous; run it beside the event loop that serves the gateway.
    return await asyncio.to_thread(CliRunner().invoke, cli, list(args), env=env)


async def test_submit_list_inspect_cancel(scheduler, nodes, tmp_path: Path) -> None:
    node = nodes(slots=2)
    await node.beat()
    spec_file = tmp_path / "job.yaml"
    spec_file.write_text("name: cli-job\nresources: {nodes: 1, gpus_per_node: 2}\ntrain: {steps: 10}\n")
    r = await vigil(scheduler, "submit", str(spec_file), "--json")
    assert r.exit_code == 0, r.output
    job = json.loads(r.output)
    assert job["name"] == "cli-job"

    r = await vigil(scheduler, "jobs")
    assert r.exit_code == 0 and job["id"] in r.output and "cli-job" in r.output
    listed = json.loads((await vigil(scheduler, "jobs", "--json")).output)
    assert [j["id"] for j in listed["items"]] == [job["id"]]
    r = await vigil(scheduler, "job", job["id"])
    assert r.exit_code == 0 and "submitted" in r.output
    r = await vigil(scheduler, "nodes")
    assert r.exit_code == 0 and node.name in r.output
    gpus = json.loads((await vigil(scheduler, "gpus", "--json")).output)["items"]
    assert {g["node"] for g in gpus} == {node.name}
    assert (await vigil(scheduler, "gpus")).exit_code == 0

    r = await vigil(scheduler, "cancel", job["id"])
    assert r.exit_code == 0 and "CANCELLED" in r.output
    r = await vigil(scheduler, "cancel", job["id"])
    assert r.exit_code == 1 and "HTTP 409" in r.output

    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"name": "x", "train": {"lr": 5}}))
    r = await vigil(scheduler, "submit", str(bad))
    assert r.exit_code == 1 and "HTTP 422" in r.output and "train.lr" in r.output
    r = await vigil(scheduler, "jobs", token="y" * 24)
    assert r.exit_code == 1 and "HTTP 401" in r.output


async def test_submit_follow_streams_until_the_job_ends(scheduler, nodes, bus: Bus, tmp_path: Path) -> None:
    node = nodes(slots=1)
    await node.beat()
    spec_file = tmp_path / "job.json"
    spec_file.write_text(
        json.dumps({"name": "followed", "resources": {"gpus_per_node": 1}, "train": {"steps": 5}})
    )
    follow = asyncio.create_task(vigil(scheduler, "submit", str(spec_file), "--follow"))
    job_id = await _newest_job(scheduler)
    launch = await launched(bus, job_id)
    await start_ranks(bus, launch)
    await exit_rank(bus, launch, 0, 0)
    r = await asyncio.wait_for(follow, 20)
    assert r.exit_code == 0, r.output
    assert "SUCCEEDED" in r.output and "all 1 ranks exited 0" in r.output


async def _newest_job(scheduler) -> str:
    async def newest() -> str | None:
        items = (await scheduler.http.get("/api/v1/jobs")).json()["items"]
        return items[0]["id"] if items else None

    return await eventually(newest, what="the submission to land")


async def test_status_names_the_active_scheduler(scheduler) -> None:
    r = await vigil(scheduler, "status", "--json")
    assert r.exit_code == 0, r.output
    active = json.loads(r.output)["active"]
    assert [(h["role"], h["instance"].split("@")[0]) for h in active] == [("scheduler", str(os.getpid()))]
    r = await vigil(scheduler, "status")
    assert r.exit_code == 0 and "scheduler" in r.output and "guardian" in r.output and "none" in r.output


async def test_users_made_with_the_admins_token_own_their_jobs(scheduler, tmp_path: Path) -> None:
    r = await vigil(scheduler, "users", "add", "alice", "--team", "vision", "--gpus", "2")
    assert r.exit_code == 0 and "quota 2 GPUs" in r.output, r.output
    r = await vigil(scheduler, "users", "token", "alice")
    assert r.exit_code == 0, r.output
    alice = r.output.strip()
    r = await vigil(scheduler, "users", "whoami", token=alice)
    assert r.exit_code == 0 and r.output.startswith("alice, team vision;") and "user:alice" in r.output
    spec_file = tmp_path / "job.yaml"
    spec_file.write_text("name: big\nresources: {nodes: 1, gpus_per_node: 4}\ntrain: {steps: 10}\n")
    r = await vigil(scheduler, "submit", str(spec_file), token=alice)
    assert r.exit_code == 1 and "HTTP 422" in r.output and "user alice's quota of 2" in r.output
    r = await vigil(scheduler, "users", "list", token=alice)
    assert r.exit_code == 1 and "HTTP 403" in r.output
    r = await vigil(scheduler, "users", "team", "vision", "--gpus", "8")
    assert r.exit_code == 0 and "quota 8 GPUs" in r.output, r.output
    r = await vigil(scheduler, "users", "list")
    assert r.exit_code == 0 and "alice" in r.output and "vision" in r.output
    assert (await vigil(scheduler, "users", "revoke", "alice")).exit_code == 0
    r = await vigil(scheduler, "users", "whoami", token=alice)
    assert r.exit_code == 1 and "HTTP 401" in r.output
