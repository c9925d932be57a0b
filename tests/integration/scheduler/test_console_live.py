"""The console's job page has one live source: the job's `changed` events (/console/events?job=) and
the one document they say to refetch (/console/data/jobs/{id}). With the real scheduler and telemetry
on real NATS and Postgres and a running job, the steps, a NaN incident, a checkpoint, the halt and
the rollback arrive on the bus as the workers and the guardian send them, and each shows in the
document the page refetches on a `changed`, with no reload: header, curves, marks and tables alike."""

from __future__ import annotations

import asyncio
import math
from collections.abc import AsyncIterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.helpers import service, step_completed
from vigil.events import IncidentRaised, RanksHalted, RollbackCompleted, StepCompleted
from vigil_common import subjects
from vigil_common.settings import Settings
from vigil_telemetry.main import run as telemetry

from .conftest import Running, checkpoint, launched, spec, start_ranks, wait_state

pytestmark = pytest.mark.integration

NAN_STEP = 10


async def changes(http: httpx.AsyncClient, job_id: str) -> AsyncIterator[str]:
    """The versions the job's event stream announces, as they come."""
    async with http.stream("GET", "/console/events", params={"job": job_id}, timeout=None) as stream:
        assert stream.status_code == 200 and stream.headers["content-type"].startswith("text/event-stream")
        event = None
        async for line in stream.aiter_lines():
            if line.startswith("event:"):
                event = line.removeprefix("event:").strip()
            elif line.startswith("data:") and event == "changed":
                yield line.removeprefix("data:").strip()
            elif not line:
                event = None


def step(job_id: str, attempt: int, k: int, rank: int, node: str, t0: datetime) -> StepCompleted:
    loss = math.nan if (k, rank) == (NAN_STEP, 1) else 3.0 - 0.1 * k
    at = t0 + timedelta(seconds=k, milliseconds=rank)
    return step_completed(job_id, k, rank, loss=loss, attempt=attempt, node=node, tokens=512, occurred_at=at)


async def test_a_running_jobs_incident_and_checkpoint_reach_its_page_without_a_reload(
    scheduler: Running, nodes, bus, db_url: str, nats_url: str, tmp_path: Path
) -> None:
    node = nodes(slots=2)
    telemetry_settings = Settings.load(
        nats_url=nats_url, database_url=db_url, data_dir=tmp_path / "telemetry", metrics_port=0
    )
    async with service(telemetry, telemetry_settings):
        r = await scheduler.http.post("/api/v1/jobs", json=spec("live"))
        assert r.status_code == 201, r.text
        job_id = r.json()["id"]
        launch = await launched(bus, job_id)
        await start_ranks(bus, launch)
        await wait_state(bus, job_id, "RUNNING")

        seen: list[dict[str, Any]] = []

        async def document() -> dict[str, Any]:
            r = await scheduler.http.get(f"/console/data/jobs/{job_id}")
            assert r.status_code == 200, r.text
            seen.append(r.json())
            return seen[-1]

        stream = changes(scheduler.http, job_id)
        async with asyncio.timeout(60):
            first = await anext(stream)  # at once, on connecting
            doc = await document()
            while doc["job"]["state"] != "RUNNING":  # the page as a browser opens it: running, no step yet
                await anext(stream)
                doc = await document()
            assert first and doc["incidents"] == [] and doc["checkpoints"] == []
            assert doc["series"]["x"] == [] and doc["job"]["last_step"] is None and not doc["job"]["finished"]

            # what the workers and the guardian send while the page stays open
            t0 = datetime.now(UTC)
            for k in range(NAN_STEP + 1):
                for p in launch.placement:
                    await bus.publish(subjects.step(job_id, p.node), step(job_id, 1, k, p.rank, p.node, t0))
            await checkpoint(bus, job_id, 1, 5, node.name)
            incident = IncidentRaised(
                job_id=job_id,
                attempt=1,
                kind="nan",
                action="rollback",
                step=NAN_STEP,
                rank=1,
                node=node.name,
                message=f"non-finite values on rank 1 at step {NAN_STEP}: loss=nan",
                evidence={"loss": "NaN"},
            )
            await bus.publish(subjects.incident(job_id), incident)
            await bus.publish(
                subjects.status(job_id, node.name),
                RanksHalted(job_id=job_id, attempt=1, step=NAN_STEP, command_id="halt-1", node=node.name),
            )
            await bus.publish(
                subjects.status(job_id, node.name),
                RollbackCompleted(
                    job_id=job_id,
                    attempt=1,
                    from_step=NAN_STEP + 1,
                    to_step=5,
                    checkpoint=f"/ckpt/{job_id}/step_00000005",
                    command_id="rollback-1",
                    duration_s=0.2,
                    node=node.name,
                ),
            )

            def complete(doc: dict[str, Any]) -> bool:
                return (
                    doc["job"]["last_step"] == NAN_STEP
                    and doc["series"]["last_step"] == NAN_STEP
                    and len(doc["incidents"]) == 1
                    and len(doc["checkpoints"]) == 1
                    and len(doc["marks"]["rollbacks"]) == 1
                    and doc["job"]["state"] == "RUNNING"
                )

            # each refetch is the page's answer to a `changed`: no reload, no timer
            while not complete(doc):
                await anext(stream)
                doc = await document()
        await stream.aclose()

    # everything on the page, from the one document
    assert doc["job"]["attempt"] == 1 and doc["job"]["steps"] == 20
    (shown,) = doc["incidents"]
    assert (shown["kind"], shown["step"], shown["rank"], shown["action"]) == ("nan", NAN_STEP, 1, "rollback")
    assert shown["id"] == incident.event_id and shown["evidence"] == {"loss": "NaN"}
    (saved,) = doc["checkpoints"]
    assert saved["step"] == 5 and saved["valid"] and saved["path"].endswith("step_00000005")
    assert [h["step"] for h in doc["marks"]["halts"]] == [NAN_STEP]
    assert [(r["from_step"], r["to_step"]) for r in doc["marks"]["rollbacks"]] == [(NAN_STEP + 1, 5)]
    series = doc["series"]
    assert series["x"] == list(range(NAN_STEP + 1)) and series["ranks"] == [0, 1]
    assert series["metrics"]["loss"]["bad"] == [NAN_STEP]  # the NaN, flagged at its step
    assert series["metrics"]["loss"]["ranks"][1][NAN_STEP] is None
    assert [a["ended"] for a in doc["attempts"]] == ["running"]
    assert len({d["version"] for d in seen}) >= 2  # refetched on each change, not once at the end


async def test_the_job_page_is_a_frame_and_its_stream_starts_with_the_version(scheduler: Running) -> None:
    r = await scheduler.http.post("/api/v1/jobs", json=spec("frame"))
    job_id = r.json()["id"]
    page = await scheduler.http.get(f"/jobs/{job_id}", headers={"Accept": "text/html"})
    assert page.status_code == 200
    assert 'id="incidents"' in page.text and 'id="checkpoints"' in page.text and "loading…" in page.text
    assert 'href="/console/states.css"' in page.text
    css = await scheduler.http.get("/console/states.css")
    assert css.status_code == 200 and css.headers["content-type"].startswith("text/css")
    assert ".state.PENDING {" in css.text
    doc = (await scheduler.http.get(f"/console/data/jobs/{job_id}")).json()
    async with asyncio.timeout(30):
        stream = changes(scheduler.http, job_id)
        assert await anext(stream) == doc["version"]  # nothing changed since: the page keeps its document
        await stream.aclose()
    assert doc["job"]["state"] == "PENDING" and doc["attempts"] == []
    assert (await scheduler.http.get("/console/data/jobs/j-missing")).status_code == 404
    assert (await scheduler.http.get("/console/events", params={"job": "j-missing"})).status_code == 404
