"""Two hosts made of network namespaces (`netns.Network`): hosta and hostb, each with its own loopback,
address, host name and `eth0` on a bridge to this (the test's) namespace; NATS listens on the bridge's
address here, so the hosts reach it, and the control plane (scheduler with its gateway, telemetry,
guardian) runs in this process on the session's Postgres, which only this namespace needs. Workers and
their ranks run in the hosts. Skipped only where this is not root or `ip`, `nsenter` or `unshare` are
missing."""

from __future__ import annotations

import asyncio
import contextlib
import shutil
import sys
import tempfile
import uuid
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import asyncpg
import httpx
import pytest

from tests.helpers import eventually
from tests.integration.scheduler.conftest import fresh_database
from vigil.events import NodeHeartbeat
from vigil_bench.hosts import Workers, cannot_make_hosts
from vigil_bench.netns import Network, remove_leftovers
from vigil_cli.stack import SERVICES, run_services
from vigil_common import subjects
from vigil_common.bus import Bus
from vigil_common.db import create_pool
from vigil_common.embedded import EmbeddedNats, free_port
from vigil_common.settings import Settings

TOKEN = "multihost-token-0123456789abcdef"


@pytest.fixture(scope="module")
def network(request: pytest.FixtureRequest) -> Iterator[Network]:
    """hosta and hostb for one test module (making them takes a tenth of a second; a module's `HOSTS`
    names others); removed after it, at exit, or on SIGTERM/SIGHUP, whatever happens."""
    if reason := cannot_make_hosts():
        pytest.skip(reason)
    remove_leftovers()
    net = Network.create(list(getattr(request.module, "HOSTS", ["a", "b"])))
    try:
        yield net
    finally:
        net.destroy()


@pytest.fixture(scope="module")
def host_nats(network: Network) -> Iterator[str]:
    """A NATS (JetStream) listening on the bridge's address: reachable from this namespace and the hosts."""
    folder = Path(tempfile.mkdtemp(prefix="vigil-mh-nats-"))
    try:
        with EmbeddedNats(folder, host=network.gateway) as server:
            probe = network.hosts[0].run(
                [sys.executable, "-c", f"import socket; socket.create_connection(('{network.gateway}', "
                 f"{server.port}), timeout=5)"]
            )  # fmt: skip
            assert probe.returncode == 0, f"hosta cannot reach NATS at {server.url}: {probe.stderr}"
            yield server.url
    finally:
        shutil.rmtree(folder, ignore_errors=True)


@dataclass
class Plane:
    """The control plane in this process: its gateway on the bridge's address, its own database."""

    settings: Settings
    http: httpx.AsyncClient
    bus: Bus
    pool: asyncpg.Pool
    nats_url: str

    @property
    def url(self) -> str:
        return f"http://{self.settings.http_host}:{self.settings.http_port}"

    async def submit(self, spec: dict[str, Any]) -> str:
        response = await self.http.post("/api/v1/jobs", json=spec)
        assert response.status_code == 201, response.text
        return str(response.json()["id"])

    async def alive(self) -> set[str]:
        items = (await self.http.get("/api/v1/nodes", params={"limit": 500})).json()["items"]
        return {n["name"] for n in items if n["alive"]}


@pytest.fixture(scope="module")
async def plane(
    request: pytest.FixtureRequest,
    network: Network,
    host_nats: str,
    database_url: str,
    tmp_path_factory: pytest.TempPathFactory,
) -> AsyncIterator[Plane]:
    """Scheduler and gateway, telemetry, guardian: no worker (the workers run in the hosts). A module's
    `PLANE` adds settings."""
    db = await fresh_database(database_url)
    settings = Settings.load(
        nats_url=host_nats,
        database_url=db,
        data_dir=tmp_path_factory.mktemp("mh-plane"),
        http_host=network.gateway,
        http_port=free_port(network.gateway),
        api_token=TOKEN,
        heartbeat_interval_s=0.5,
        metrics_port=0,
        **getattr(request.module, "PLANE", {}),
    )
    stop = asyncio.Event()
    services = asyncio.create_task(run_services(settings, stop, SERVICES[:3]))
    bus = await Bus.connect(host_nats, "multihost-test")
    pool = await create_pool(db, max_size=3)
    http = httpx.AsyncClient(
        base_url=f"http://{settings.http_host}:{settings.http_port}",
        headers={"Authorization": f"Bearer {TOKEN}"},
        timeout=10,
    )
    try:

        async def ready() -> bool:
            if services.done():
                services.result()
            with contextlib.suppress(httpx.HTTPError):
                r = await http.get("/readyz")
                return r.status_code == 200 and r.json().get("role") == "active"
            return False

        await eventually(ready, timeout=60, what="the control plane")
        yield Plane(settings, http, bus, pool, host_nats)
    finally:
        stop.set()
        await asyncio.wait_for(services, 60)
        await http.aclose()
        await pool.close()
        await bus.close()


@pytest.fixture
def workers(host_nats: str, tmp_path: Path) -> Iterator[Workers]:
    found = Workers(host_nats, tmp_path)
    try:
        yield found
    finally:
        found.stop()


async def wait_alive(plane: Plane, workers: Workers, *nodes: str, timeout: float = 60) -> None:
    """Until the scheduler counts `nodes` alive and no other (an earlier test's workers, stopped, are lost
    after three heartbeat intervals): placement then has these nodes only. A worker that exits meanwhile
    fails at once with its log."""

    async def up() -> bool:
        dead = [w for w in workers.started if w.proc.poll() is not None and w.node in nodes]
        assert not dead, f"worker {dead[0].node} exited {dead[0].proc.returncode}\n{workers.logs()}"
        return set(nodes) == await plane.alive()

    await eventually(up, timeout=timeout, what=f"workers {nodes} alive")


async def heartbeat_of(bus: Bus, node: str, timeout: float = 30) -> NodeHeartbeat:
    async with bus.watch(subjects.heartbeat(node)) as beats:
        beat = await asyncio.wait_for(anext(beats), timeout)
    assert isinstance(beat, NodeHeartbeat)
    return beat


def unique(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:6]}"


async def stored_steps(
    plane: Plane, reference: str, job_id: str
) -> tuple[dict[tuple[int, int], float], dict[tuple[int, int, int], Any]]:
    """What telemetry stored of two jobs' steps: the fault-free `reference`'s loss by (step, rank), and
    `job_id`'s rows by (attempt, step, rank)."""
    rows = await plane.pool.fetch(
        "SELECT job_id, attempt, step, rank, loss, occurred_at FROM telemetry_steps"
        " WHERE job_id = ANY($1::text[])",
        [reference, job_id],
    )
    ref = {(r["step"], r["rank"]): r["loss"] for r in rows if r["job_id"] == reference}
    got = {(r["attempt"], r["step"], r["rank"]): r for r in rows if r["job_id"] == job_id}
    return ref, got
