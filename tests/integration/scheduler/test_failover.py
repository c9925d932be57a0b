"""Failure handling end to end: a lost node's job fails over to another node from its last checkpoint;
a scheduler killed mid-job and restarted rebuilds from Postgres and launches nothing twice."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from tests.helpers import eventually, step_completed
from vigil.events import IncidentRaised
from vigil_common import subjects
from vigil_common.bus import Bus
from vigil_common.db import create_pool
from vigil_common.embedded import free_port

from .conftest import (
    HEARTBEAT_S,
    TOKEN,
    checkpoint,
    count_on,
    exit_rank,
    launched,
    next_event,
    spec,
    start_ranks,
    wait_ready,
    wait_state,
)

pytestmark = pytest.mark.integration


async def test_lost_node_fails_over_to_the_other_node_from_the_last_checkpoint(
    scheduler, nodes, bus: Bus
) -> None:
    a, b = nodes(slots=2), nodes(slots=2)
    await a.beat()
    await b.beat()
    job = (await scheduler.http.post("/api/v1/jobs", json=spec())).json()
    first = await launched(bus, job["id"])
    victim = a if first.placement[0].node == a.name else b
    survivor = b if victim is a else a
    assert {p.node for p in first.placement} == {victim.name}
    await start_ranks(bus, first)
    await wait_state(bus, job["id"], "RUNNING")
    last = await checkpoint(bus, job["id"], 1, 20, victim.name)

    await victim.stop()  # the worker dies: no more heartbeats
    second = await launched(bus, job["id"], attempt=2, timeout_s=10 * HEARTBEAT_S * 3)
    assert {p.node for p in second.placement} == {survivor.name}
    assert second.resume_from == last and second.master_addr == survivor.address
    requeued = await wait_state(bus, job["id"], "PENDING", attempt=2)
    assert requeued.cause == f"node {victim.name} lost (no heartbeat for 3 intervals)"
    incident = await next_event(bus, subjects.incident(job["id"]), lambda e: isinstance(e, IncidentRaised))
    assert incident.kind == "node_lost" and incident.node == victim.name and incident.attempt == 1

    listed = {n["name"]: n for n in (await scheduler.http.get("/api/v1/nodes")).json()["items"]}
    assert not listed[victim.name]["alive"] and listed[survivor.name]["alive"]
    await start_ranks(bus, second)
    await wait_state(bus, job["id"], "RUNNING", attempt=2)


def _scheduler_process(
    db_url: str, nats_url: str, port: int, data_dir: Path, log: Path
) -> subprocess.Popen[bytes]:
    env = dict(
        os.environ,
        VIGIL_DATABASE_URL=db_url,
        VIGIL_NATS_URL=nats_url,
        VIGIL_HTTP_PORT=str(port),
        VIGIL_API_TOKEN=TOKEN,
        VIGIL_HEARTBEAT_INTERVAL_S=str(HEARTBEAT_S),
        VIGIL_DATA_DIR=str(data_dir),
        VIGIL_LOG_LEVEL="INFO",
    )
    vigil = Path(sys.executable).parent / "vigil"
    with log.open("ab") as out:
        return subprocess.Popen([str(vigil), "scheduler"], env=env, stdout=out, stderr=subprocess.STDOUT)


async def test_scheduler_killed_and_restarted_mid_job_launches_nothing_twice(
    db_url: str, nats_url: str, nodes, bus: Bus, tmp_path: Path
) -> None:
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    log = tmp_path / "scheduler.log"
    node = nodes(slots=2)
    await node.beat()
    proc = _scheduler_process(db_url, nats_url, port, tmp_path, log)
    pool = await create_pool(db_url, max_size=2)
    try:
        await wait_ready(base)
        async with httpx.AsyncClient(base_url=base, headers={"Authorization": f"Bearer {TOKEN}"}) as http:
            job = (await http.post("/api/v1/jobs", json=spec("survives"))).json()
        jid = job["id"]
        first = await launched(bus, jid)
        await start_ranks(bus, first)
        await wait_state(bus, jid, "RUNNING")

        proc.send_signal(signal.SIGKILL)  # no drain, no goodbye
        proc.wait(timeout=10)
        # The job goes on while the scheduler is away: steps and a checkpoint.
        await bus.publish(
            subjects.step(jid, node.name),
            step_completed(jid, 0, loss=5.0, node=node.name, tokens=64, tokens_per_s=100.0),
        )
        await checkpoint(bus, jid, 1, 0, node.name)
        # As if the crash came between publishing the launch and recording it: the relay re-publishes,
        # JetStream drops the copy by its Nats-Msg-Id.
        reset = await pool.execute("UPDATE outbox SET published_at = NULL WHERE job_id = $1", jid)
        assert reset.startswith("UPDATE ") and reset != "UPDATE 0"

        proc = _scheduler_process(db_url, nats_url, port, tmp_path, log)
        await wait_ready(base)

        async def relayed() -> bool:
            return await pool.fetchval("SELECT count(*) FROM outbox WHERE published_at IS NULL") == 0

        await eventually(relayed, what="the restarted relay to catch up")
        await exit_rank(bus, first, 0, 0)
        await exit_rank(bus, first, 1, 0)
        await wait_state(bus, jid, "SUCCEEDED")
        assert await count_on(bus, subjects.JOBS.name, subjects.launch(jid)) == 1
        async with httpx.AsyncClient(base_url=base, headers={"Authorization": f"Bearer {TOKEN}"}) as http:
            got = (await http.get(f"/api/v1/jobs/{jid}")).json()
        assert got["attempt"] == 1
        assert [t["to_state"] for t in got["transitions"]] == ["PENDING", "SCHEDULED", "RUNNING", "SUCCEEDED"]
        assert (
            await pool.fetchval("SELECT count(*) FROM scheduler_checkpoints WHERE job_id = $1", jid) == 1
        )  # consumed after the restart from the durable consumer
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
        await pool.close()
        if proc.returncode not in (0, -signal.SIGTERM):
            print(log.read_text()[-4000:])
