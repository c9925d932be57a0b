"""Vigil under a real Slurm: the control plane in this process, workers started by slurmd through the
example `deploy/slurm/vigil-job.sbatch` (`vigil slurm run`), real DeepSpeed ranks inside the step.
A two-rank job SUCCEEDS and its allocation ends; a cancelled job frees its Slurm step."""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.helpers import eventually
from tests.integration.scheduler.conftest import fresh_database, next_event, wait_state
from vigil.events import RankStarted, StepCompleted
from vigil_cli.slurm import worker_name
from vigil_cli.stack import SERVICES, run_services
from vigil_common import subjects
from vigil_common.bus import Bus
from vigil_common.embedded import free_port
from vigil_common.settings import Settings

from .conftest import SlurmCluster

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.slurm]

TOKEN = "slurm-token-0123456789abcdef"
TINY = {"preset": "tiny", "n_layer": 2, "seq_len": 32}
TRAIN = {"micro_batch": 4, "lr": 3e-3, "warmup_steps": 1, "zero_stage": 0}


@dataclass
class Plane:
    http: httpx.AsyncClient
    bus: Bus
    url: str
    nats_url: str


@pytest.fixture(scope="module")
async def plane(
    nats_url: str, database_url: str, tmp_path_factory: pytest.TempPathFactory
) -> AsyncIterator[Plane]:
    """Scheduler with its gateway, telemetry and guardian: no worker, the workers come from Slurm."""
    port = free_port()
    settings = Settings.load(
        nats_url=nats_url,
        database_url=await fresh_database(database_url),
        data_dir=tmp_path_factory.mktemp("plane"),
        http_port=port,
        api_token=TOKEN,
        heartbeat_interval_s=0.5,
        metrics_port=0,
    )
    stop = asyncio.Event()
    services = asyncio.create_task(run_services(settings, stop, SERVICES[:3]))
    bus = await Bus.connect(nats_url, "slurm-test")
    url = f"http://127.0.0.1:{port}"
    http = httpx.AsyncClient(base_url=url, headers={"Authorization": f"Bearer {TOKEN}"})
    try:

        async def ready() -> bool:
            if services.done():
                services.result()
            with contextlib.suppress(httpx.HTTPError):
                return (await http.get("/readyz")).status_code == 200
            return False

        await eventually(ready, timeout=60, what="the control plane")
        yield Plane(http, bus, url, nats_url)
    finally:
        stop.set()
        await asyncio.wait_for(services, 60)
        await http.aclose()
        await bus.close()


def sbatch(cluster: SlurmCluster, plane: Plane, work: Path, spec: dict[str, Any]) -> str:
    """The example batch script on one node, against this module's control plane."""
    return cluster.sbatch(
        work, spec, nats_url=plane.nats_url, api_url=plane.url, token=TOKEN, args=("--nodes=1",)
    )


def proc_environ(pid: int) -> list[bytes]:
    return Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")


def parent_of(pid: int) -> int:
    stat = Path(f"/proc/{pid}/stat").read_text()
    return int(stat.rsplit(")", 1)[1].split()[1])  # the field after the state


def is_rank(pid: int) -> bool:
    try:
        return b"vigil_trainer" in Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return False


async def test_a_two_rank_job_per_sbatch_succeeds_and_ends_its_allocation(
    plane: Plane, slurm_cluster: SlurmCluster, tmp_path: Path
) -> None:
    name = "slurm-ok-" + uuid.uuid4().hex[:6]
    spec = {
        "name": name,
        "resources": {"nodes": 1, "gpus_per_node": 2},
        "model": TINY,
        "train": {"steps": 6, **TRAIN},
        "checkpoint": {"every": 3},
    }
    slurm_id = sbatch(slurm_cluster, plane, tmp_path, spec)
    job_id = await slurm_cluster.vigil_job(plane.http, name, tmp_path, slurm_id)
    await wait_state(plane.bus, job_id, "SUCCEEDED", timeout_s=240)

    job = (await plane.http.get(f"/api/v1/jobs/{job_id}")).json()
    assert [(p["node"], p["rank"]) for p in job["placement"]] == [
        (worker_name(slurm_cluster.node, slurm_id), 0),
        (worker_name(slurm_cluster.node, slurm_id), 1),
    ]
    assert await slurm_cluster.ended(slurm_id) == "COMPLETED"  # `vigil slurm run` exited 0
    assert slurm_cluster.steps(slurm_id) == []


async def test_cancelling_the_vigil_job_frees_the_slurm_step(
    plane: Plane, slurm_cluster: SlurmCluster, tmp_path: Path
) -> None:
    name = "slurm-cancel-" + uuid.uuid4().hex[:6]
    spec = {
        "name": name,
        "resources": {"nodes": 1, "gpus_per_node": 2},
        "model": TINY,
        "train": {"steps": 5000, **TRAIN},
        "checkpoint": {"every": 1000},
    }
    slurm_id = sbatch(slurm_cluster, plane, tmp_path, spec)
    job_id = await slurm_cluster.vigil_job(plane.http, name, tmp_path, slurm_id)
    started = await next_event(
        plane.bus, subjects.job_status(job_id), lambda e: isinstance(e, RankStarted), timeout_s=120
    )
    await next_event(
        plane.bus, subjects.job_steps(job_id), lambda e: isinstance(e, StepCompleted), timeout_s=120
    )
    # the rank runs inside the Slurm step the workers run in: its worker (its parent) is the step's
    # process; the rank's own environment is built from an allowlist and holds no SLURM_ variable
    worker = proc_environ(parent_of(started.pid))
    assert f"SLURM_JOB_ID={slurm_id}".encode() in worker
    assert any(v.startswith(b"SLURM_STEP_ID=") for v in worker)
    assert not any(v.startswith(b"SLURM_") for v in proc_environ(started.pid))
    assert len(slurm_cluster.steps(slurm_id)) == 2  # the batch step and the workers' step

    assert (await plane.http.post(f"/api/v1/jobs/{job_id}/cancel")).status_code < 300
    await wait_state(plane.bus, job_id, "CANCELLED", timeout_s=60)
    assert await slurm_cluster.ended(slurm_id) == "FAILED"  # `vigil slurm run` exits 1
    assert slurm_cluster.steps(slurm_id) == []
    assert not is_rank(started.pid)
