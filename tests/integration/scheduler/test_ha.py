"""Two `vigil scheduler` processes on one database: both answer the gateway, one at a time schedules
(`vigil_common.lease`). The active one is killed (SIGKILL) in a burst of submits and cancels:
the other takes over within VIGIL_TAKEOVER_S, and every job ends in one final state, none
placed twice, every device free."""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest

from tests.helpers import ServiceProcess, eventually
from vigil.events import LaunchJob
from vigil.jobstates import TERMINAL_STATES
from vigil_common import subjects
from vigil_common.bus import Bus
from vigil_common.embedded import free_port

from .conftest import HEARTBEAT_S, TOKEN, FakeNode, exit_rank, fresh_database, start_ranks

pytestmark = [pytest.mark.integration, pytest.mark.ha]

TAKEOVER_S = 3.0
JOBS = 20


class SchedulerProcess(ServiceProcess):
    def __init__(self, database_url: str, nats_url: str, data_dir: Path) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        env = {
            "VIGIL_DATABASE_URL": database_url,
            "VIGIL_NATS_URL": nats_url,
            "VIGIL_DATA_DIR": str(data_dir),
            "VIGIL_HTTP_PORT": str(self.port),
            "VIGIL_API_TOKEN": TOKEN,
            "VIGIL_HEARTBEAT_INTERVAL_S": str(HEARTBEAT_S),
            "VIGIL_NODE_LOST_AFTER": "8",
            "VIGIL_TAKEOVER_S": str(TAKEOVER_S),
        }
        super().__init__("scheduler", env, data_dir / f"scheduler-{self.port}.log")

    async def role(self) -> str | None:
        async with httpx.AsyncClient(timeout=2) as http:
            try:
                r = await http.get(f"{self.url}/readyz")
            except httpx.HTTPError:
                return None
        return r.json().get("role") if r.status_code == 200 else None


@pytest.fixture
async def pair(
    database_url: str, nats_url: str, tmp_path: Path
) -> AsyncIterator[tuple[SchedulerProcess, ...]]:
    db = await fresh_database(database_url)
    first = SchedulerProcess(db, nats_url, tmp_path)
    second = SchedulerProcess(db, nats_url, tmp_path)
    try:
        yield first, second
    finally:
        for s in (first, second):
            s.stop()


@contextlib.asynccontextmanager
async def fake_workers(bus: Bus, node: FakeNode) -> AsyncIterator[dict[str, list[int]]]:
    """What the node's worker would do: each launched attempt's ranks start, then exit 0."""
    attempts: dict[str, list[int]] = {}

    async def run() -> None:
        async with bus.watch(subjects.ALL_LAUNCHES) as launches:
            async for launch in launches:
                if isinstance(launch, LaunchJob) and launch.placement[0].node == node.name:
                    attempts.setdefault(launch.job_id or "", []).append(launch.attempt)
                    await start_ranks(bus, launch)
                    for p in launch.placement:
                        await exit_rank(bus, launch, p.rank, 0)

    task = asyncio.create_task(run())
    try:
        yield attempts
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


async def test_the_active_scheduler_killed_in_a_burst_loses_no_job_and_frees_every_device(
    pair: tuple[SchedulerProcess, SchedulerProcess], bus: Bus
) -> None:
    first, second = pair
    roles = await eventually(
        lambda: _both(first, second), timeout=60, what="both schedulers answering, one of them active"
    )
    assert sorted(roles) == ["active", "standby"], roles
    active, standby = (first, second) if roles[0] == "active" else (second, first)
    node = FakeNode(bus, f"ha-{uuid.uuid4().hex[:6]}", slots=4).start()
    headers = {"Authorization": f"Bearer {TOKEN}"}
    job_ids: list[str] = []
    try:
        async with fake_workers(bus, node) as attempts, httpx.AsyncClient(headers=headers, timeout=5) as http:

            async def submit(k: int, gateways: list[SchedulerProcess]) -> str:
                body = {"name": f"ha-{k}", "resources": {"gpus_per_node": 1}, "train": {"steps": 5}}
                key = {"Idempotency-Key": f"ha-{k}-{uuid.uuid4().hex}"}
                for gateway in gateways:  # a client whose gateway died retries on the other
                    try:
                        r = await http.post(f"{gateway.url}/api/v1/jobs", json=body, headers=key)
                    except httpx.HTTPError:
                        continue
                    assert r.status_code in (200, 201), r.text
                    return str(r.json()["id"])
                raise AssertionError(f"submit {k} reached no gateway")

            async def took_over() -> bool:
                return await standby.role() == "active"

            handover: asyncio.Task[float] | None = None
            for k in range(JOBS):
                gateways = [active, standby] if k % 2 else [standby, active]
                if k == JOBS // 2:  # mid-burst, the active scheduler dies
                    active.kill()
                    handover = asyncio.create_task(_seconds_until(took_over, TAKEOVER_S + 10))
                job_ids.append(await submit(k, [g for g in gateways if g.proc.poll() is None]))
                if k % 3 == 2:  # every third is cancelled, placed or not
                    r = await http.post(f"{standby.url}/api/v1/jobs/{job_ids[-1]}/cancel")
                    assert r.status_code in (200, 409), r.text

            assert handover is not None
            handover_s = await handover
            plane = (await http.get(f"{standby.url}/api/v1/control-plane")).json()["active"]
            assert [(h["role"], h["instance"].split("@")[0]) for h in plane] == [
                ("scheduler", str(standby.proc.pid))
            ], plane
            print(f"scheduler hand-over: {handover_s:.2f}s after SIGKILL (takeover setting {TAKEOVER_S}s)")
            assert handover_s <= TAKEOVER_S + 5

            async def all_ended() -> list[dict] | None:
                jobs = [(await http.get(f"{standby.url}/api/v1/jobs/{j}")).json() for j in job_ids]
                return jobs if all(j["state"] in TERMINAL_STATES for j in jobs) else None

            jobs = await eventually(all_ended, timeout=90, what="every job in a final state")
            for job in jobs:
                finals = [t for t in job["transitions"] if t["to_state"] in TERMINAL_STATES]
                assert len(finals) == 1, job["transitions"]  # one final state
                assert job["attempt"] == 1 and attempts.get(job["id"], [1]) == [1], job  # placed once at most
            assert {j["state"] for j in jobs} <= {"SUCCEEDED", "CANCELLED"}
            assert sum(j["state"] == "SUCCEEDED" for j in jobs) >= JOBS // 2

            async def devices_free() -> bool:
                nodes = (await http.get(f"{standby.url}/api/v1/nodes")).json()["items"]
                mine = [n for n in nodes if n["name"] == node.name]
                return bool(mine) and all(d["job_id"] is None for d in mine[0]["devices"])

            await eventually(devices_free, timeout=30, what="every device free")
    finally:
        await node.stop()


async def _seconds_until(check, timeout_s: float) -> float:  # type: ignore[no-untyped-def]
    """Seconds from now until `check` holds (polled as fast as it answers)."""
    start = time.monotonic()
    await eventually(check, timeout=timeout_s, what="the standby taking over")
    return time.monotonic() - start


async def _both(first: SchedulerProcess, second: SchedulerProcess) -> list[str] | None:
    roles = [await first.role(), await second.role()]
    return roles if None not in roles and "active" in roles else None
