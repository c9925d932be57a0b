"""Workers started as in production (`vigil worker` processes), and a recorder of a job's events."""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import signal
import subprocess
import sys
import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from vigil import events as ev
from vigil.spec import parse_spec
from vigil_common import subjects
from vigil_common.bus import Bus
from vigil_common.embedded import free_port


@dataclass
class WorkerProc:
    node: str
    proc: subprocess.Popen[bytes]
    log: Path


@dataclass
class Cluster:
    """Two workers on this machine, one CPU slot each, sharing one data dir (as nodes share storage)."""

    data_dir: Path
    workers: list[WorkerProc]

    @property
    def checkpoint_root(self) -> Path:
        return (self.data_dir / "checkpoints").resolve()

    def nodes(self) -> list[str]:
        return [w.node for w in self.workers]


def start_worker(nats_url: str, data_dir: Path, node: str, slots: int, **more: str) -> WorkerProc:
    env = dict(os.environ)
    env.update(more)
    env.update(
        VIGIL_NATS_URL=nats_url,
        VIGIL_DATA_DIR=str(data_dir),
        VIGIL_NODE_NAME=node,
        VIGIL_CPU_SLOTS=str(slots),
        VIGIL_HEARTBEAT_INTERVAL_S="0.5",
        VIGIL_GPU_SAMPLE_INTERVAL_S="1",
        OMP_NUM_THREADS="1",  # two ranks share this machine's two cores
    )
    log = data_dir / f"worker-{node}.log"
    vigil = Path(sys.executable).parent / "vigil"
    with log.open("ab") as out:
        proc = subprocess.Popen([str(vigil), "worker"], env=env, stdout=out, stderr=subprocess.STDOUT)
    return WorkerProc(node=node, proc=proc, log=log)


def stop_worker(w: WorkerProc) -> None:
    if w.proc.poll() is None:
        w.proc.send_signal(signal.SIGTERM)
        try:
            w.proc.wait(30)
        except subprocess.TimeoutExpired:
            w.proc.kill()


async def wait_heartbeat(bus: Bus, node: str, timeout: float = 60.0) -> ev.NodeHeartbeat:
    async with bus.watch(subjects.heartbeat(node)) as beats:
        return await asyncio.wait_for(anext(beats), timeout)  # type: ignore[return-value]


@contextlib.contextmanager
def two_workers(nats_url: str, data_dir: Path, **env: str) -> Iterator[Cluster]:
    """Two workers on `data_dir`, `env` added to theirs; stopped, and their ranks ended, on exit."""
    tag = uuid.uuid4().hex[:6]
    workers = [start_worker(nats_url, data_dir, f"node-{tag}-{x}", 1, **env) for x in "ab"]
    try:
        yield Cluster(data_dir=data_dir, workers=workers)
    finally:
        for w in workers:
            stop_worker(w)
            shutil.rmtree(Path("/dev/shm") / f"vigil-{w.node}", ignore_errors=True)  # its jobs' snapshots
        # ranks outlive their worker by design; end whatever a failed test left running
        for pidfile in data_dir.glob("worker/*/ranks.json"):
            import json

            for r in json.loads(pidfile.read_text()).get("ranks", []):
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(r["pid"], signal.SIGKILL)


@pytest.fixture(scope="module")
def cluster(nats_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    with two_workers(nats_url, tmp_path_factory.mktemp("worker-data")) as c:
        yield c


async def heartbeating(cluster: Cluster, bus: Bus) -> Cluster:
    """The cluster, once both workers have heartbeated (so their launch consumers exist)."""
    for w in cluster.workers:
        assert w.proc.poll() is None, w.log.read_text()[-3000:]
        await wait_heartbeat(bus, w.node)
    return cluster


@pytest.fixture
async def ready_cluster(cluster: Cluster, bus: Bus) -> Cluster:
    return await heartbeating(cluster, bus)


def tiny_spec(**train: Any) -> dict[str, Any]:
    """The tiny preset made tinier: two ranks, short sequences, a few steps."""
    spec: dict[str, Any] = {
        "name": "worker-test",
        "resources": {"nodes": 2, "gpus_per_node": 1},
        "model": {"preset": "tiny", "n_layer": 2, "seq_len": 32},
        "train": {"steps": 8, "micro_batch": 4, "lr": 3e-3, "warmup_steps": 1, "zero_stage": 1, "seed": 0},
        "checkpoint": {"every": 4, "keep": 5},
    }
    faults = train.pop("faults", [])
    checkpoint = train.pop("checkpoint", None)
    spec["train"].update(train)
    if checkpoint:
        spec["checkpoint"] = checkpoint
    spec["faults"] = faults
    return spec


def launch(cluster: Cluster, job_id: str, spec: dict[str, Any], **extra: Any) -> ev.LaunchJob:
    """Rank 0 on the first worker, rank 1 on the second."""
    a, b = cluster.nodes()
    placement = [
        ev.RankPlacement(rank=0, node=a, device=0, local_rank=0),
        ev.RankPlacement(rank=1, node=b, device=0, local_rank=0),
    ]
    return launch_on(placement, job_id, spec, **extra)


def launch_on(
    placement: list[ev.RankPlacement], job_id: str, spec: dict[str, Any], **extra: Any
) -> ev.LaunchJob:
    return ev.LaunchJob(
        job_id=job_id,
        attempt=extra.pop("attempt", 1),
        spec=parse_spec(spec),
        placement=placement,
        master_addr="127.0.0.1",
        master_port=free_port(),
        **extra,
    )


@dataclass
class Recorder:
    """Every step and status event of one job, with a way to wait for a condition on them."""

    events: list[ev.Message] = field(default_factory=list)
    changed: asyncio.Condition = field(default_factory=asyncio.Condition)

    def of(self, cls: type[ev.Message], **match: Any) -> list[Any]:
        return [
            e for e in self.events if isinstance(e, cls) and all(getattr(e, k) == v for k, v in match.items())
        ]

    async def until(
        self, predicate: Callable[[Recorder], Any], timeout: float = 120.0, *, fail_on_exit: bool = True
    ) -> Any:
        """Wait until `predicate(self)` is truthy; fail at once if a rank dies meanwhile."""

        async def wait() -> Any:
            async with self.changed:
                while not (result := predicate(self)):
                    dead = [e for e in self.of(ev.RankExited) if e.failure != "ok"]
                    if fail_on_exit and dead:
                        raise AssertionError(f"a rank died: {dead[0].failure}\n{dead[0].log_tail}")
                    await self.changed.wait()
                return result

        return await asyncio.wait_for(wait(), timeout)

    def exits(self, attempt: int = 1) -> dict[int, ev.RankExited]:
        return {e.rank: e for e in self.of(ev.RankExited, attempt=attempt)}


@contextlib.asynccontextmanager
async def record(bus: Bus, job_id: str) -> AsyncIterator[Recorder]:
    rec = Recorder()
    async with bus.watch(subjects.job_steps(job_id), subjects.job_status(job_id)) as stream:

        async def pump() -> None:
            async for event in stream:
                async with rec.changed:
                    rec.events.append(event)
                    rec.changed.notify_all()

        task = asyncio.create_task(pump())
        try:
            yield rec
        finally:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task


async def until_exited(rec: Recorder, attempt: int = 1, timeout: float = 120.0) -> dict[int, ev.RankExited]:
    """Both ranks' RankExited, whatever their failure."""
    await rec.until(lambda r: len(r.exits(attempt)) == 2, timeout, fail_on_exit=False)
    return rec.exits(attempt)


def rank_logs(cluster: Cluster, job_id: str, tail: int = 4000) -> str:
    logs = sorted((cluster.data_dir / "logs" / job_id).glob("*.log"))
    return "\n".join(p.read_text()[-tail:] for p in logs)
