"""Two hosts made of network namespaces (`netns.Network`): hosta and hostb, each with its own loopback,
address, host name and `eth0` on a bridge to this (the test's) namespace; NATS listens on the bridge's
address here, so the hosts reach it, and the control plane (scheduler with its gateway, telemetry,
guardian) runs in this process on the session's Postgres, which only this namespace needs. Workers and
their ranks run in the hosts. Skipped only where this is not root or `ip`, `nsenter` or `unshare` are
missing."""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import uuid
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import asyncpg
import httpx
import pytest

from tests.helpers import eventually
from tests.integration.scheduler.conftest import fresh_database
from vigil.events import NodeHeartbeat
from vigil_cli.stack import SERVICES, run_services
from vigil_common import subjects
from vigil_common.bus import Bus
from vigil_common.db import create_pool
from vigil_common.embedded import EmbeddedNats, free_port
from vigil_common.settings import Settings
from vigil_worker.warm import STANDBY_MODULE

from .netns import Host, Network, remove_leftovers

TOKEN = "multihost-token-0123456789abcdef"
VIGIL = str(Path(sys.executable).parent / "vigil")


def _cannot_make_hosts() -> str | None:
    if os.geteuid() != 0:
        return "network namespaces need root"
    missing = [b for b in ("ip", "nsenter", "unshare") if not shutil.which(b)]
    if missing:
        return f"{', '.join(missing)} not found: scripts/install.sh installs iproute2 (ip); util-linux has the rest"
    return None


@pytest.fixture(scope="module")
def network(request: pytest.FixtureRequest) -> Iterator[Network]:
    """hosta and hostb for one test module (making them takes a tenth of a second; a module's `HOSTS`
    names others); removed after it, at exit, or on SIGTERM/SIGHUP, whatever happens."""
    if reason := _cannot_make_hosts():
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


@dataclass
class HostWorker:
    host: Host
    node: str
    proc: subprocess.Popen[bytes]
    log: Path


@dataclass
class Workers:
    """`vigil worker` processes started in the hosts by one test, on a data dir they share (as nodes share
    checkpoint storage); stopped, with whatever their ranks left running, when the test ends."""

    nats_url: str
    data_dir: Path
    started: list[HostWorker] = field(default_factory=list)

    def start(self, host: Host, *, slots: int = 1, node: str | None = None, **env: str) -> HostWorker:
        """A worker in `host`, advertising the host's address; named after the host (its UTS host name,
        Vigil's default node name) unless `node` is given."""
        full = {k: v for k, v in os.environ.items() if not k.startswith("VIGIL_")}
        full.update(
            VIGIL_NATS_URL=self.nats_url,
            VIGIL_DATA_DIR=str(self.data_dir),
            VIGIL_NODE_ADDRESS=host.address,
            VIGIL_CPU_SLOTS=str(slots),
            VIGIL_HEARTBEAT_INTERVAL_S="0.5",
            VIGIL_GPU_SAMPLE_INTERVAL_S="1",
            OMP_NUM_THREADS="1",  # the hosts share this machine's cores
            **env,
        )
        if node is not None:
            full["VIGIL_NODE_NAME"] = node
        log = self.data_dir / f"worker-{node or host.hostname}-{len(self.started)}.log"
        with log.open("ab") as out:
            proc = host.popen([VIGIL, "worker"], env=full, stdout=out, stderr=subprocess.STDOUT)
        worker = HostWorker(host, node or host.hostname, proc, log)
        self.started.append(worker)
        return worker

    def logs(self) -> str:
        return "\n".join(
            f"== {w.log.name}\n{w.log.read_text(errors='replace')[-3000:]}" for w in self.started
        )

    def kill(self, host: Host) -> None:
        """SIGKILL this test's workers in `host` and their ranks (the machine dies)."""
        for w in self.started:
            if w.host is host and w.proc.poll() is None:
                w.proc.kill()
                w.proc.wait()
        self._kill_ranks(host)

    def _kill_ranks(self, host: Host) -> None:
        """Ranks outlive their worker by design: end this test's (their command lines name its data dir)
        and the warm ranks in the host (a launched one runs a job's rank under the standby's command line;
        the workers of the tests before closed theirs)."""
        marks = (str(self.data_dir).encode(), STANDBY_MODULE.encode())
        for pid in host.pids():
            with contextlib.suppress(OSError):
                if any(mark in Path(f"/proc/{pid}/cmdline").read_bytes() for mark in marks):
                    os.kill(pid, signal.SIGKILL)

    def stop(self) -> None:
        for w in self.started:
            if w.proc.poll() is None:
                w.proc.send_signal(signal.SIGTERM)
        for w in self.started:
            try:
                w.proc.wait(20)
            except subprocess.TimeoutExpired:
                w.proc.kill()
                w.proc.wait()
        for host in {w.host.netns: w.host for w in self.started}.values():
            self._kill_ranks(host)


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
