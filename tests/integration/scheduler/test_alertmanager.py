"""An `alertmanager` route against Debian's real Alertmanager (`prometheus-alertmanager`, installed by
scripts/install.sh): a job's incidents arrive as alerts labelled alertname, job, kind, team, severity,
grouped by job in Alertmanager's own API, and are resolved when the job runs again."""

from __future__ import annotations

import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import yaml

from tests.helpers import eventually, service, stop
from vigil.events import IncidentRaised, JobStateChanged
from vigil.jobstates import JobState
from vigil_common import subjects
from vigil_common.embedded import free_port
from vigil_telemetry.main import run as telemetry

from .test_alert_routes import ROUTES, submitted, telemetry_settings

pytestmark = pytest.mark.integration

CONFIG = {
    "route": {"receiver": "none", "group_by": ["alertname", "job"], "group_wait": "1s"},
    "receivers": [{"name": "none"}],
}


@pytest.fixture
def alertmanager(tmp_path: Path) -> Iterator[str]:
    binary = shutil.which("prometheus-alertmanager") or shutil.which("alertmanager")
    if binary is None:
        pytest.skip("alertmanager missing (Debian's prometheus-alertmanager; scripts/install.sh installs it)")
    config = tmp_path / "alertmanager.yml"
    config.write_text(yaml.safe_dump(CONFIG))
    port = free_port()
    log = (tmp_path / "alertmanager.log").open("wb")
    proc = subprocess.Popen(
        [binary, f"--config.file={config}", f"--storage.path={tmp_path / 'am'}",
         f"--web.listen-address=127.0.0.1:{port}", "--cluster.listen-address=", "--log.level=warn"],
        stdout=log, stderr=subprocess.STDOUT,
    )  # fmt: skip
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        stop(proc)
        log.close()


async def test_incidents_are_grouped_alerts_resolved_when_the_job_runs_again(
    scheduler, as_user, bus, nats_url, tmp_path, alertmanager
):
    alice = await as_user("alice", "ml")
    job = await submitted(alice, "watched")
    async with httpx.AsyncClient(base_url=alertmanager, timeout=5) as am:

        async def ready() -> bool:
            try:
                return (await am.get("/-/ready")).status_code == 200
            except httpx.HTTPError:
                return False

        await eventually(ready, timeout=20, what="alertmanager ready")
        r = await alice.post(ROUTES, json={"name": "ops", "url": alertmanager, "format": "alertmanager"})
        assert r.status_code == 201 and r.json()["secret"] is None, r.text
        route = r.json()["id"]

        async with service(telemetry, telemetry_settings(scheduler, nats_url, tmp_path)):
            for kind in ("nan", "spike"):
                raised = IncidentRaised(job_id=job, attempt=1, kind=kind, action="rollback", message=kind)
                await bus.publish(subjects.incident(job), raised)

            async def grouped():
                groups = (await am.get("/api/v2/alerts/groups")).json()
                ours = [g for g in groups if g["labels"].get("job") == job]
                return ours if ours and len(ours[0]["alerts"]) == 2 else None

            (group,) = await eventually(grouped, timeout=15, what="two alerts in the job's group")
            assert group["labels"] == {"alertname": "VigilIncident", "job": job}
            labels = sorted((a["labels"] for a in group["alerts"]), key=lambda a: a["kind"])
            assert labels == [
                {"alertname": "VigilIncident", "job": job, "kind": k, "team": "ml", "severity": "error"}
                for k in ("nan", "spike")
            ]
            (alert,) = [a for a in group["alerts"] if a["labels"]["kind"] == "nan"]
            assert alert["annotations"]["console"] == f"https://vigil.example/jobs/{job}"
            assert alert["status"]["state"] == "active"

            back = JobStateChanged(job_id=job, attempt=1, from_state="ROLLING_BACK", to_state=JobState.RUNNING,
                                   cause="rolled back")  # fmt: skip
            await bus.publish(subjects.status(job, subjects.CONTROL), back)

            async def resolved():
                active = (await am.get("/api/v2/alerts", params={"filter": f'job="{job}"'})).json()
                return active == []

            await eventually(resolved, timeout=15, what="the job's alerts resolved")

            expected = [("firing", "delivered", 1)] * 2 + [("resolved", "delivered", 1)] * 2

            async def logged():
                items = (await alice.get(f"{ROUTES}/{route}/deliveries")).json()["items"]
                found = sorted((d["phase"], d["status"], d["attempts"]) for d in items)
                return found if found == expected else None

            await eventually(logged, timeout=10, what=f"the delivery log to be {expected}")
