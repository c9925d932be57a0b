"""`vigil watch` against the real bus: live incidents and job events, readable or JSON."""

from __future__ import annotations

import asyncio
import json

import pytest

from tests.helpers import eventually
from vigil.events import CheckpointSaved, IncidentRaised, JobStateChanged
from vigil_cli.observe import format_json, format_line, watch_events
from vigil_common import subjects
from vigil_common.settings import Settings

pytestmark = pytest.mark.integration


async def test_watch_shows_new_incidents_and_job_events(bus, nats_url, job_id, tmp_path):
    settings = Settings.load(nats_url=nats_url, data_dir=tmp_path)
    seen: list = []
    stop = asyncio.Event()
    ready = asyncio.Event()
    watcher = asyncio.create_task(watch_events(settings, job_id, seen.append, stop, ready))
    await asyncio.wait_for(ready.wait(), 10)
    other = "j-" + "0" * 12
    events = [
        JobStateChanged(
            job_id=job_id, attempt=1, from_state="SCHEDULED", to_state="RUNNING", cause="ranks up"
        ),
        IncidentRaised(job_id=other, kind="hang", action="alert", message="someone else's"),
        CheckpointSaved(
            job_id=job_id, attempt=1, step=4, path="/c/4", bytes=9, manifest_sha256="x", data_position=4
        ),
        IncidentRaised(
            job_id=job_id, attempt=1, kind="nan", action="rollback", step=5, rank=0, message="nan"
        ),
    ]

    for e in events:
        origin = subjects.CONTROL if isinstance(e, JobStateChanged) else "n0"
        subject = (
            subjects.incident(e.job_id) if e.type == "incident.raised" else subjects.status(job_id, origin)
        )
        await bus.publish(subject, e)
    await eventually(lambda: _at_least(seen, 3), timeout=15, what="the watcher to see the events")
    stop.set()
    await asyncio.wait_for(watcher, 10)
    kinds = [e.type for e in seen]
    assert sorted(set(kinds)) == ["checkpoint.saved", "incident.raised", "job.state_changed"]
    assert all(e.job_id == job_id for e in seen)  # --job filters
    lines = [format_line(e) for e in seen]
    assert any("INCIDENT nan -> ROLLBACK  step 5 rank 0: nan" in line for line in lines)
    assert all(json.loads(format_json(e))["job_id"] == job_id for e in seen)


async def _at_least(items: list, n: int) -> bool:
    return len(items) >= n
