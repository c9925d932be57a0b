"""A job's ranks are a tenant. The probe ran a hostile `entrypoint` job beside a victim on one worker and,
its ranks being the worker's user, read every secret, rewrote the victim's checkpoints, killed its ranks
and left a process that outlived its own cancel. Here the whole stack runs as `vigil up` does (as root:
each job its own uid and cgroup), the victim trains with the built-in trainer, and the hostile program
(hostile_rank.py) tries each of those from inside its rank and writes down what happened. Every attempt
must have been refused, nothing of the hostile job may survive its cancel, and the victim must succeed
with its steps, attempt, state and device untouched."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from tests.helpers import eventually
from tests.integration.guardian.test_e2e_ranks import TINY, TRAIN, Stack, whole_stack
from vigil.events import JobStateChanged, RankExited, RankStarted, StepCompleted
from vigil_common import credentials, readmodel, subjects
from vigil_common.endpoints import write_endpoints
from vigil_worker.uids import processes_of

pytestmark = [
    pytest.mark.integration,
    pytest.mark.security,
    pytest.mark.skipif(os.geteuid() != 0, reason="jobs run as users of their own only under a root worker"),
]

HOSTILE = Path(__file__).with_name("hostile_rank.py")
VICTIM_STEPS = 120


@pytest.fixture(scope="module")
async def stack(
    nats_url: str, database_url: str, tmp_path_factory: pytest.TempPathFactory
) -> AsyncIterator[Stack]:
    code = tmp_path_factory.mktemp("code")
    shutil.copy(HOSTILE, code / HOSTILE.name)
    data_dir = tmp_path_factory.mktemp("tenants")
    # the control plane's secret files, written by the functions `vigil up` writes them with (0600)
    credentials.load_or_create(data_dir / credentials.CREDENTIALS_FILE)
    fd = os.open(data_dir / "nats.conf", os.O_WRONLY | os.O_CREAT, 0o600)
    os.write(fd, credentials.authorization_block({"admin": "admin-s3cret"}).encode())
    os.close(fd)
    async with whole_stack(nats_url, database_url, data_dir, "tenants", code_roots=[code]) as running:
        write_endpoints(running.settings, nats_url, database_url)
        yield running


async def submit(stack: Stack, spec: dict[str, Any]) -> str:
    response = await stack.http.post("/api/v1/jobs", json=spec)
    assert response.status_code == 201, response.text
    return str(response.json()["id"])


def alive(pid: int) -> bool:
    return Path(f"/proc/{pid}").exists()


def uid_of(pid: int) -> int:
    return os.stat(f"/proc/{pid}").st_uid


async def test_a_hostile_job_reaches_neither_the_control_planes_secrets_nor_the_job_beside_it(stack: Stack):
    data = stack.settings.data_dir.resolve()
    events: list[Any] = []
    watched = (subjects.ALL_STEPS, subjects.ALL_STATUS)
    async with stack.bus.watch(*watched) as stream:

        async def collect() -> None:
            async for e in stream:
                events.append(e)

        collector = asyncio.create_task(collect())
        try:
            victim = await submit(stack, {
                "name": "victim",
                "resources": {"nodes": 1, "gpus_per_node": 1},
                "model": TINY,
                "train": {**TRAIN, "steps": VICTIM_STEPS},
                "checkpoint": {"every": 40, "keep": 3},
            })  # fmt: skip

            async def victim_training() -> int | None:
                started = [e for e in events if isinstance(e, RankStarted) and e.job_id == victim]
                stepped = any(isinstance(e, StepCompleted) and e.job_id == victim for e in events)
                return started[0].pid if started and stepped else None

            victim_pid = await eventually(victim_training, timeout=120, what="the victim's first step")
            targets = {
                "data_dir": str(data),
                "node": stack.node,
                "victim_job": victim,
                "victim_pid": victim_pid,
            }
            hostile = await submit(stack, {
                "name": "hostile",
                "resources": {"nodes": 1, "gpus_per_node": 1},
                "entrypoint": {"argv": ["python", HOSTILE.name, json.dumps(targets)]},
            })  # fmt: skip
            report = data / "checkpoints" / hostile / "findings.json"

            async def findings_written() -> dict[str, str] | None:
                return json.loads(report.read_text()) if report.exists() else None

            findings = await eventually(findings_written, timeout=120, what="the hostile rank's findings")
            hostile_uid, escapee = int(findings.pop("uid")), int(findings.pop("escapee pid"))
            groups = findings.pop("groups")
            print(json.dumps(findings, indent=1))  # the attacks and their outcomes, for the record

            # --- every attempt was refused ------------------------------------------------------------
            assert findings and all(v.startswith("denied") for v in findings.values()), findings
            assert findings["kill the victim's rank"] == "denied: PermissionError errno 1"  # EPERM: alive
            assert hostile_uid not in (0, os.getuid(), uid_of(victim_pid)), (hostile_uid, uid_of(victim_pid))
            assert groups in ("", str(hostile_uid)), "no supplementary group"
            assert uid_of(escapee) == hostile_uid  # the double-forked child runs, for now

            # --- nothing of the hostile job outlives its cancel ----------------------------------------
            assert (await stack.http.post(f"/api/v1/jobs/{hostile}/cancel")).status_code == 200

            async def hostile_gone() -> bool:
                return not processes_of(hostile_uid) and not alive(escapee)

            await eventually(hostile_gone, timeout=60, what="every process of the hostile job's uid to end")

            async def ended(job: str) -> str | None:
                states = [e.to_state for e in events if isinstance(e, JobStateChanged) and e.job_id == job]
                return states[-1] if states and states[-1] in ("SUCCEEDED", "FAILED", "CANCELLED") else None

            assert (
                await eventually(lambda: ended(hostile), timeout=60, what="the hostile job's end")
                == "CANCELLED"
            )
            # --- the victim: untouched, and it succeeds --------------------------------------------------
            assert (
                await eventually(lambda: ended(victim), timeout=300, what="the victim's end") == "SUCCEEDED"
            )
        finally:
            collector.cancel()
    exits = [e for e in events if isinstance(e, RankExited) and e.job_id == victim]
    assert [(e.attempt, e.failure) for e in exits] == [(1, "ok")], exits
    steps = await readmodel.steps(stack.pool, victim, aggregate=True, limit=VICTIM_STEPS + 10)
    assert sorted(s["step"] for s in steps["items"]) == list(range(VICTIM_STEPS))
    assert {s["attempt"] for s in steps["items"]} == {1}
    assert not (data / "checkpoints" / victim / "planted").exists()
    nodes = (await stack.http.get("/api/v1/nodes")).json()["items"]
    (node,) = [n for n in nodes if n["name"] == stack.node]
    assert node["alive"] and not [d for d in node.get("devices", []) if d.get("healthy") is False], node
