"""A scheduler per test (in-process, its own fresh database, a free HTTP port) on the session's
real NATS and Postgres, plus simulated worker nodes that publish heartbeats and rank events."""

from __future__ import annotations

import asyncio
import contextlib
import os
import subprocess
import sys
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import asyncpg
import httpx
import pytest

from vigil.events import (
    CheckpointSaved,
    Device,
    JobStateChanged,
    LaunchJob,
    Message,
    NodeHeartbeat,
    RankExited,
    RankStarted,
)
from vigil_common import subjects
from vigil_common.bus import Bus
from vigil_common.db import create_pool, migrate
from vigil_common.embedded import free_port
from vigil_common.settings import Settings
from vigil_scheduler.main import run

TOKEN = "test-token-0123456789abcdef"
HEARTBEAT_S = 0.25


async def fresh_database(server_url: str) -> str:
    """A new, migrated database on the session's server, so each scheduler starts from nothing."""
    name = "sched_" + uuid.uuid4().hex[:12]
    conn = await asyncpg.connect(server_url)
    try:
        await conn.execute(f'CREATE DATABASE "{name}"')
    finally:
        await conn.close()
    parts = urlsplit(server_url)
    url = urlunsplit(parts._replace(path="/" + name))
    pool = await create_pool(url)
    try:
        await migrate(pool)
    finally:
        await pool.close()
    return url


@pytest.fixture
async def db_url(database_url: str) -> str:
    return await fresh_database(database_url)


def scheduler_settings(db_url: str, nats_url: str, data_dir: Path, **overrides: Any) -> Settings:
    values: dict[str, Any] = {
        "database_url": db_url,
        "nats_url": nats_url,
        "data_dir": data_dir,
        "http_port": free_port(),
        "api_token": TOKEN,
        "heartbeat_interval_s": HEARTBEAT_S,
        "node_lost_after": 3,
        "max_attempts": 3,
        "max_body_bytes": 64 * 1024,
    }
    values.update(overrides)
    return Settings.load(**values)


@dataclass
class Running:
    settings: Settings
    http: httpx.AsyncClient
    pool: asyncpg.Pool

    @property
    def base_url(self) -> str:
        return f"http://{self.settings.http_host}:{self.settings.http_port}"


async def wait_ready(
    base_url: str,
    timeout_s: float = 30.0,
    task: asyncio.Task[None] | None = None,
    process: subprocess.Popen[bytes] | None = None,
) -> None:
    """Poll /readyz until the gateway answers 200 as the active scheduler (the one consuming heartbeats
    and placing jobs: the only one of a test's schedulers, once it holds the lock); fail at once if the
    scheduler's `task` or `process` ended first."""
    deadline = asyncio.get_running_loop().time() + timeout_s
    async with httpx.AsyncClient(base_url=base_url, timeout=2) as http:
        while True:
            if task is not None and task.done():
                task.result()
                raise AssertionError("the scheduler exited before it was ready")
            if process is not None and process.poll() is not None:
                raise AssertionError(f"the scheduler exited ({process.returncode}) before it was ready")
            with contextlib.suppress(httpx.HTTPError):
                r = await http.get("/readyz")
                if r.status_code == 200 and r.json().get("role") == "active":
                    return
            if asyncio.get_running_loop().time() > deadline:
                raise TimeoutError(f"{base_url} not ready in {timeout_s}s")
            await asyncio.sleep(0.05)  # polling a readiness endpoint


@pytest.fixture
async def scheduler(db_url: str, nats_url: str, tmp_path: Path) -> AsyncIterator[Running]:
    async with running(scheduler_settings(db_url, nats_url, tmp_path)) as started:
        yield started


@contextlib.asynccontextmanager
async def running(settings: Settings) -> AsyncIterator[Running]:
    """A scheduler with `settings` (`scheduler_settings`), ready, with an admin's HTTP client."""
    db_url = settings.database_url or ""
    stop = asyncio.Event()
    task = asyncio.create_task(run(settings, stop))
    pool = await create_pool(db_url, max_size=3)
    base = f"http://{settings.http_host}:{settings.http_port}"
    try:
        await wait_ready(base, task=task)
        async with httpx.AsyncClient(
            base_url=base, headers={"Authorization": f"Bearer {TOKEN}"}, timeout=10
        ) as http:
            yield Running(settings, http, pool)
    finally:
        stop.set()
        await asyncio.wait_for(task, timeout=20)
        await pool.close()


@pytest.fixture
async def as_user(scheduler: Running) -> AsyncIterator[Callable[..., Awaitable[httpx.AsyncClient]]]:
    """`await as_user(name, team, gpus=None, admin=False)`: the user, made (or updated) with the admin's
    token through the API, and an HTTP client holding a new token of theirs."""
    made: list[httpx.AsyncClient] = []

    async def make(
        name: str, team: str | None = None, *, gpus: int | None = None, admin: bool = False
    ) -> httpx.AsyncClient:
        r = await scheduler.http.put(
            f"/api/v1/users/{name}", json={"team": team, "gpus": gpus, "admin": admin}
        )
        assert r.status_code == 200, r.text
        r = await scheduler.http.post(f"/api/v1/users/{name}/tokens")
        assert r.status_code == 201, r.text
        client = httpx.AsyncClient(
            base_url=scheduler.base_url, headers={"Authorization": f"Bearer {r.json()['token']}"}, timeout=10
        )
        made.append(client)
        return client

    yield make
    for client in made:
        await client.aclose()


@dataclass
class FakeNode:
    """A simulated worker: heartbeats every HEARTBEAT_S with `slots` CPU devices until stopped."""

    bus: Bus
    name: str
    slots: int = 2
    address: str = "127.0.0.1"
    busy: set[int] = field(default_factory=set)
    sick: set[int] = field(default_factory=set)
    kind: str = "cpu"
    _task: asyncio.Task[None] | None = None
    started_at: datetime = field(default_factory=lambda: datetime.now(UTC))

    def heartbeat(self) -> NodeHeartbeat:
        return NodeHeartbeat(
            node=self.name,
            address=self.address,
            devices=[
                Device(
                    index=i,
                    kind=self.kind,
                    name=f"{self.kind}-{i}",
                    uuid=f"{self.name}-{i}",  # type: ignore[arg-type]
                    healthy=i not in self.sick,
                )
                for i in range(self.slots)
            ],
            free=[i for i in range(self.slots) if i not in self.busy],
            interval_s=HEARTBEAT_S,
            started_at=self.started_at,
        )

    async def beat(self) -> None:
        await self.bus.publish(subjects.heartbeat(self.name), self.heartbeat())

    def start(self) -> FakeNode:
        async def loop() -> None:
            while True:
                await self.beat()
                await asyncio.sleep(HEARTBEAT_S)  # the heartbeat period itself, not synchronisation

        self._task = asyncio.create_task(loop())
        return self

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None


@pytest.fixture
async def nodes(bus: Bus) -> AsyncIterator[Callable[..., FakeNode]]:
    made: list[FakeNode] = []

    def make(slots: int = 2, **kw: Any) -> FakeNode:
        node = FakeNode(bus, f"n-{uuid.uuid4().hex[:8]}", slots, **kw).start()
        made.append(node)
        return node

    yield make
    for node in made:
        await asyncio.wait_for(node.stop(), 10)


async def next_event(
    bus: Bus,
    subject: str,
    predicate: Callable[[Message], bool],
    timeout_s: float = 15.0,
) -> Message:
    """The first message on `subject` (from the stream's start) that satisfies `predicate`."""
    async with bus.watch(subject, from_start=True) as events:

        async def first() -> Message:
            async for event in events:
                if predicate(event):
                    return event
            raise AssertionError("watch ended")

        return await asyncio.wait_for(first(), timeout_s)


async def wait_state(
    bus: Bus,
    job_id: str,
    state: str,
    timeout_s: float = 15.0,
    attempt: int | None = None,
    cause: str = "",
) -> JobStateChanged:
    """The first JobStateChanged of the job to `state` (of `attempt`, with a cause starting with `cause`)."""
    event = await next_event(
        bus,
        subjects.job_status(job_id),
        lambda e: (
            isinstance(e, JobStateChanged)
            and e.to_state == state
            and attempt in (None, e.attempt)
            and e.cause.startswith(cause)
        ),
        timeout_s,
    )
    assert isinstance(event, JobStateChanged)
    return event


async def count_on(bus: Bus, stream: str, subject: str) -> int:
    """How many messages the stream holds on `subject` (on every subject it matches, for a wildcard)."""
    info = await bus.js.stream_info(stream, subjects_filter=subjects.stored(subject))  # as stored
    return sum((info.state.subjects or {}).values())


def spec(name: str = "t", nodes: int = 1, per_node: int = 2, **extra: Any) -> dict[str, Any]:
    return {
        "name": name,
        "resources": {"nodes": nodes, "gpus_per_node": per_node},
        "train": {"steps": 20},
        **extra,
    }


async def launched(bus: Bus, job_id: str, attempt: int = 1, timeout_s: float = 15.0) -> LaunchJob:
    event = await next_event(
        bus, subjects.launch(job_id), lambda e: isinstance(e, LaunchJob) and e.attempt == attempt, timeout_s
    )
    assert isinstance(event, LaunchJob)
    return event


async def start_ranks(bus: Bus, launch: LaunchJob) -> None:
    """What the workers publish once the launch's ranks run."""
    for p in launch.placement:
        await bus.publish(
            subjects.status(launch.job_id or "", p.node),
            RankStarted(
                job_id=launch.job_id,
                attempt=launch.attempt,
                rank=p.rank,
                node=p.node,
                pid=4000 + p.rank,
                log_path=f"/tmp/{launch.job_id}-{p.rank}.log",
            ),
        )


async def exit_rank(
    bus: Bus,
    launch: LaunchJob,
    rank: int,
    code: int | None,
    attempt: int | None = None,
    failure: str | None = None,
) -> None:
    node = launch.placement[rank].node
    await bus.publish(
        subjects.status(launch.job_id or "", node),
        RankExited(
            job_id=launch.job_id,
            attempt=attempt or launch.attempt,
            rank=rank,
            node=node,
            exit_code=code,
            signal=None if code is not None else 15,
            failure=failure or ("ok" if code == 0 else "error"),  # type: ignore[arg-type]
        ),
    )


async def checkpoint(bus: Bus, job_id: str, attempt: int, step: int, node: str) -> str:
    """Rank 0's worker (on `node`) reports a checkpoint."""
    path = f"/ckpt/{job_id}/step_{step:08d}"
    await bus.publish(
        subjects.status(job_id, node),
        CheckpointSaved(
            job_id=job_id,
            attempt=attempt,
            step=step,
            path=path,
            bytes=1000,
            manifest_sha256="0" * 64,
            data_position=step + 1,
        ),
    )
    return path


GATEWAY_TOKEN = "fuzz-token-0123456789abcdef"  # the `gateway` fixture's API token


@contextlib.contextmanager
def scheduler_process(
    nats_url: str, database_url: str, tmp_path: Path, settings: dict[str, str], ready_s: float
) -> Iterator[str]:
    """A real `vigil scheduler` process on a fresh database of its own, with `settings` (`VIGIL_*`) on top
    of the servers' and a free port: its base URL once it answers /readyz as the active scheduler within
    `ready_s` (it must not exit meanwhile); terminated after."""
    db = asyncio.run(fresh_database(database_url))
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("VIGIL_")} | {
        "VIGIL_NATS_URL": nats_url,
        "VIGIL_DATABASE_URL": db,
        "VIGIL_DATA_DIR": str(tmp_path),
        "VIGIL_HTTP_PORT": str(port),
        **settings,
    }
    proc = subprocess.Popen([str(Path(sys.executable).parent / "vigil"), "scheduler"], env=env, cwd=tmp_path)
    base = f"http://127.0.0.1:{port}"
    try:
        asyncio.run(wait_ready(base, timeout_s=ready_s, process=proc))
        yield base
    finally:
        proc.terminate()
        proc.wait(30)


@pytest.fixture
def gateway(nats_url: str, database_url: str, tmp_path: Path) -> Iterator[str]:
    """A real `vigil scheduler` process on its own fresh database (the API fuzz and coverage runs):
    its base URL; bearer `GATEWAY_TOKEN`, bodies up to 64 KiB."""
    settings = {"VIGIL_API_GATEWAY_TOKEN": GATEWAY_TOKEN, "VIGIL_MAX_BODY_BYTES": str(64 * 1024)}
    with scheduler_process(nats_url, database_url, tmp_path, settings, ready_s=60) as base:
        yield base
