"""Debian's real Prometheus, with deploy/prometheus/prometheus.yml pointed at a running telemetry service
(real NATS and Postgres): events published on the bus become series Prometheus scrapes and answers
queries about through its HTTP API."""

from __future__ import annotations

import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from tests.helpers import eventually, launch_on, service, step_completed, stop
from vigil.events import GpuSampled, IncidentRaised, JobStateChanged, StepCompleted
from vigil_common import subjects
from vigil_common.bus import Bus
from vigil_common.embedded import free_port
from vigil_common.settings import Settings
from vigil_telemetry.main import run

pytestmark = [pytest.mark.integration, pytest.mark.slow]

CONFIG = Path(__file__).resolve().parents[3] / "deploy" / "prometheus" / "prometheus.yml"


def prometheus_config(metrics_port: int) -> dict[str, Any]:
    """The deployed configuration, its target this test's telemetry, scraped every second."""
    config = yaml.safe_load(CONFIG.read_text())
    config["global"]["scrape_interval"] = "1s"
    (scrape,) = config["scrape_configs"]
    scrape["static_configs"] = [{"targets": [f"127.0.0.1:{metrics_port}"]}]
    return config


@pytest.fixture
def metrics_port() -> int:
    return free_port()


@pytest.fixture
def prometheus(metrics_port: int, tmp_path: Path) -> Iterator[str]:
    binary = shutil.which("prometheus")
    if binary is None:
        pytest.skip("prometheus missing (Debian's prometheus package; scripts/install.sh installs it)")
    config = tmp_path / "prometheus.yml"
    config.write_text(yaml.safe_dump(prometheus_config(metrics_port)))
    port = free_port()
    log = (tmp_path / "prometheus.log").open("wb")
    proc = subprocess.Popen(
        [binary, f"--config.file={config}", f"--storage.tsdb.path={tmp_path / 'tsdb'}",
         f"--web.listen-address=127.0.0.1:{port}", "--log.level=warn"],
        stdout=log, stderr=subprocess.STDOUT,
    )  # fmt: skip
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        stop(proc)
        log.close()


def step(job: str, rank: int, k: int, loss: float) -> StepCompleted:
    return step_completed(
        job, k, rank, loss=loss, node="n0", tokens=512, tokens_per_s=2000.0, step_time_s=0.25
    )


async def query(prom: httpx.AsyncClient, promql: str) -> dict[str, float]:
    """An instant query's result: each series' labels (without Prometheus' own) as text, and its value."""
    r = await prom.get("/api/v1/query", params={"query": promql})
    body = r.json()
    assert body["status"] == "success", body
    out = {}
    for item in body["data"]["result"]:
        labels = {k: v for k, v in item["metric"].items() if k not in ("instance", "__name__")}
        out[",".join(f"{k}={v}" for k, v in sorted(labels.items()))] = float(item["value"][1])
    return out


async def test_prometheus_scrapes_vigil_series_from_telemetry(
    nats_url: str, migrated: str, bus: Bus, job_id: str, prometheus: str, metrics_port: int, tmp_path: Path
) -> None:
    settings = Settings.load(
        nats_url=nats_url, database_url=migrated, data_dir=tmp_path, metrics_port=metrics_port
    )
    node = "prom-" + job_id
    await launch_on(bus, job_id, {0: "n0", 1: "n0"})
    async with service(run, settings), httpx.AsyncClient(base_url=prometheus, timeout=10) as prom:
        for k in range(3):
            for rank in (0, 1):
                await bus.publish(
                    subjects.step(job_id, "n0"), step(job_id, rank, k, loss=3.0 - k - 0.5 * rank)
                )
        await bus.publish(
            subjects.gpu(node),
            GpuSampled(
                node=node, index=0, device_kind="gpu", uuid="GPU-1", temperature_c=64.0, power_w=410.0
            ),
        )
        await bus.publish(
            subjects.incident(job_id),
            IncidentRaised(job_id=job_id, kind="spike", action="rollback", message="spike"),
        )

        async def scraped(promql: str) -> dict[str, float]:
            return await query(prom, promql)

        async def ready() -> bool:  # Prometheus answers 503 until its storage is open
            try:
                return (await prom.get("/-/ready")).status_code == 200
            except httpx.TransportError:
                return False

        await eventually(ready, timeout=60, what="Prometheus ready")
        # the target is up and Prometheus holds the job's series (its scrape runs every second)
        await eventually(lambda: scraped('up{job="vigil-telemetry"} == 1'), timeout=60, what="a first scrape")
        # the last step's values (a scrape between two steps holds an earlier one: wait for these)
        final = {f"job={job_id}": pytest.approx((1.0 + 0.5) / 2)}  # ranks 0 and 1 at step 2

        async def final_loss() -> bool:
            return await scraped(f'vigil_job_loss{{job="{job_id}"}}') == final

        await eventually(final_loss, timeout=60, what="vigil_job_loss of the last step in Prometheus")
        assert await scraped(f'vigil_step_loss{{job="{job_id}"}}') == {
            f"job={job_id},rank=0": 1.0,
            f"job={job_id},rank=1": 0.5,
        }
        assert await scraped(f'vigil_job_tokens_per_second{{job="{job_id}"}}') == {f"job={job_id}": 4000.0}
        assert await scraped(f'vigil_job_incidents_total{{job="{job_id}"}}') == {
            f"action=rollback,job={job_id},kind=spike": 1.0
        }
        gpu = await scraped(f'vigil_gpu_temperature_celsius{{node="{node}"}}')
        assert gpu == {f"index=0,job=vigil-telemetry,kind=gpu,node={node}": 64.0}

        # the job ends: its series go from /metrics, so Prometheus marks them stale
        await bus.publish(
            subjects.status(job_id, subjects.CONTROL),
            JobStateChanged(job_id=job_id, from_state="RUNNING", to_state="SUCCEEDED", cause="done"),
        )
        await eventually(
            lambda: _empty(scraped(f'vigil_job_loss{{job="{job_id}"}}')),
            timeout=60,
            what="the series to go stale",
        )


async def _empty(result: Any) -> bool:
    return not await result
