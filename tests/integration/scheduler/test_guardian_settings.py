"""A job's guardian settings changed while it runs (`PATCH /api/v1/jobs/{id}/guardian`), against a real
scheduler, NATS and Postgres, and a real guardian fed synthetic steps (no ranks): the change is validated as
the spec is, only for those who see the job, audited, and judged from the next step."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest

from tests.helpers import eventually, service, step_completed
from tests.integration.guardian.test_guardian import cfg, judged, ready
from vigil.events import GuardianSettingsChanged, IncidentRaised, LaunchJob, StepCompleted
from vigil_common import subjects
from vigil_common.bus import Bus
from vigil_guardian.main import run as run_guardian
from vigil_scheduler.console.jobpage import job_document
from vigil_scheduler.principals import SCHEDULER

from .conftest import launched, next_event, spec, start_ranks
from .test_cli import vigil

pytestmark = pytest.mark.integration

LOOSE = {"spike_zscore": 1000.0, "spike_warmup": 5, "spike": "alert"}  # lets a z ~ 25 spike pass


async def test_a_change_is_validated_as_the_spec_is_and_only_by_those_who_see_the_job(scheduler, as_user):
    alice, carol, bob = (
        await as_user("alice", "vision"),
        await as_user("carol", "vision"),
        await as_user("bob"),
    )
    job = (await alice.post("/api/v1/jobs", json=spec(guardian={"hang_timeout_s": 30.0}))).json()["id"]
    path = f"/api/v1/jobs/{job}/guardian"

    r = await alice.patch(path, json={"spike_zscor": 4.0})
    assert r.status_code == 422 and r.json()["fields"][0]["field"] == "guardian.spike_zscor", r.text
    r = await alice.patch(path, json={"spike": "reboot", "hang_floor_s": 45.0})
    assert r.status_code == 422, r.text
    assert {f["field"] for f in r.json()["fields"]} == {"guardian.spike"}, r.text  # first the values
    r = await alice.patch(path, json={"hang_floor_s": 45.0})  # over the job's hang_timeout_s
    assert r.status_code == 422 and r.json()["fields"][0]["field"] == "guardian.hang_floor_s", r.text
    r = await alice.patch(path, content=b"{not json")
    assert r.status_code == 400 and r.json()["error"] == "ClientException", r.text

    # another team's user: the answer of a job that does not exist
    theirs, none = await bob.patch(path, json={"spike_zscore": 4.0}), await bob.patch(path + "x", json={})
    assert theirs.status_code == none.status_code == 404, theirs.text
    r = await carol.patch(path, json={"spike_zscore": 4.0, "spike": "halt"})  # the owner's team may
    assert r.status_code == 200, r.text
    assert (r.json()["revision"], r.json()["changed"], r.json()["by"]) == (
        1,
        {"spike_zscore": 4.0, "spike": "halt"},
        "user:carol",
    )
    guardian = (await alice.get(f"/api/v1/jobs/{job}")).json()["spec"]["guardian"]
    assert (guardian["spike_zscore"], guardian["spike"], guardian["hang_timeout_s"]) == (4.0, "halt", 30.0)
    audited = (await alice.get("/api/v1/audit", params={"job_id": job})).json()["items"]
    assert [
        (a["action"], a["actor"], a["detail"]["revision"]) for a in audited if a["action"] == "guardian"
    ] == [("guardian", "user:carol", 1)]
    assert (await bob.get("/api/v1/audit", params={"job_id": job})).json()["items"] == []

    # the CLI: values read as in a spec, the gateway's 422 named
    done = await vigil(scheduler, "guardian", "set", job, "spike_zscore=5", "replay=false", "--json")
    assert done.exit_code == 0, done.output
    assert json.loads(done.output)["changed"] == {"spike_zscore": 5.0, "replay": False}
    bad = await vigil(scheduler, "guardian", "set", job, "spike_window=3")
    assert bad.exit_code == 1 and "guardian.spike_window" in bad.output, bad.output

    assert (await alice.post(f"/api/v1/jobs/{job}/cancel")).status_code == 200
    r = await alice.patch(path, json={"spike_zscore": 5.0})
    assert r.status_code == 409, r.text


def rank_step(launch: LaunchJob, k: int, rank: int, loss: float) -> tuple[str, StepCompleted]:
    node = launch.placement[rank].node
    event = step_completed(launch.job_id or "", k, rank, loss=loss, attempt=launch.attempt, node=node)
    return subjects.step(launch.job_id or "", node), event


async def test_a_lowered_spike_threshold_catches_a_spike_it_let_pass_after_a_guardian_restart(
    scheduler, nodes, bus: Bus, nats_url: str, tmp_path: Path
) -> None:
    nodes(slots=2)
    settings = cfg(nats_url, scheduler.settings.database_url, tmp_path / "guardian")
    r = await scheduler.http.post("/api/v1/jobs", json=spec(guardian=LOOSE, train={"steps": 1000}))
    job = r.json()["id"]
    launch = await launched(bus, job)
    await start_ranks(bus, launch)

    async def steps(first: int, last: int, spike_at: int | None = None) -> None:
        for k in range(first, last):
            for rank in (0, 1):
                loss = 3.0 if (k, rank) == (spike_at, 1) else 2.0 + 0.01 * ((k + rank) % 3 - 1)
                await bus.publish(*rank_step(launch, k, rank, loss))

    async with service(run_guardian, settings) as (task, _):
        await eventually(lambda: ready(bus), what="the guardian's consumers")
        await steps(0, 21, spike_at=20)  # z ~ 25 at step 20: under the spec's 1000
        await eventually(lambda: judged(bus, job), what="steps 0-20 judged")
        incidents = "SELECT count(*) FROM guardian_incidents WHERE job_id = $1"
        assert await scheduler.pool.fetchval(incidents, job) == 0  # saved before the input is acknowledged

        r = await scheduler.http.patch(f"/api/v1/jobs/{job}/guardian", json={"spike_zscore": 6.0})
        assert r.status_code == 200 and r.json()["from_step"] is None, r.text
        # stored (the outbox relays it after the commit): the steps published from now on come after it
        await next_event(bus, subjects.job_status(job), lambda e: isinstance(e, GuardianSettingsChanged))
        await steps(21, 23)
        await eventually(lambda: judged(bus, job), what="the change and steps 21-22 judged")
        task.cancel()  # killed, not stopped: the next guardian has only what this one saved
        with pytest.raises(asyncio.CancelledError):
            await task

    await steps(23, 26, spike_at=25)  # while no guardian runs, the same spike comes
    async with bus.watch(subjects.incident(job)) as events, service(run_guardian, settings):
        incident = await asyncio.wait_for(anext(events), 30)
    assert isinstance(incident, IncidentRaised)
    assert (incident.kind, incident.step, incident.rank, incident.action) == ("spike", 25, 1, "alert")
    assert incident.evidence["guardian_settings"] == {
        "revision": 1,
        "from_step": 21,  # the first step stored after the change
        "changed": {"spike_zscore": 6.0},
    }

    async def marked() -> list:
        doc = await job_document(scheduler.pool, job, SCHEDULER)
        return [(c["revision"], c["from_step"]) for c in doc["marks"]["settings"] if c["from_step"]]

    assert await eventually(marked, what="the change marked on the curves") == [(1, 21)]
    await scheduler.http.post(f"/api/v1/jobs/{job}/cancel")
