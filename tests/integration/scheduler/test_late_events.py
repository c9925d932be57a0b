"""Events that arrive after the ranks finished (issue 32): a rollback its ranks outran settles, and a job
whose rank's exit is never reported is resolved by the sweeper, never left ROLLING_BACK on its slots."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from vigil.events import CancelJob, HaltJob, IncidentRaised, LaunchJob, RollbackJob
from vigil_common import subjects
from vigil_common.bus import Bus

from .conftest import (
    Running,
    checkpoint,
    exit_rank,
    launched,
    next_event,
    running,
    scheduler_settings,
    spec,
    start_ranks,
    wait_state,
)

pytestmark = pytest.mark.integration

TRANSITION_TIMEOUT_S = 2.0


@pytest.fixture
async def quick(db_url: str, nats_url: str, tmp_path: Path) -> AsyncIterator[Running]:
    """A scheduler whose sweeper resolves a transition after TRANSITION_TIMEOUT_S without progress."""
    settings = scheduler_settings(db_url, nats_url, tmp_path, transition_timeout_s=TRANSITION_TIMEOUT_S)
    async with running(settings) as started:
        yield started


async def _running(quick: Running, nodes, bus: Bus) -> tuple[str, LaunchJob, str]:
    """A running two-rank job with a checkpoint at step 9: (job id, its launch, the checkpoint)."""
    node = nodes(slots=2)
    await node.beat()
    jid = (await quick.http.post("/api/v1/jobs", json=spec())).json()["id"]
    launch = await launched(bus, jid)
    await start_ranks(bus, launch)
    await wait_state(bus, jid, "RUNNING")
    return jid, launch, await checkpoint(bus, jid, 1, 9, launch.placement[0].node)


async def _nan_on_the_last_step(bus: Bus, jid: str, path: str, *, skipped: bool) -> None:
    """What the guardian sends for a NaN at step 12: halt, rollback to 9, then the incident."""
    iid = f"inc-{jid}-nan"
    reason = "non-finite values on rank 0 at step 12"
    common = {"job_id": jid, "attempt": 1, "incident_id": iid}
    await bus.publish(subjects.cmd(jid), HaltJob(event_id=f"{iid}-halt", reason=reason, **common))
    await bus.publish(
        subjects.cmd(jid),
        RollbackJob(
            event_id=f"{iid}-rollback", checkpoint=path, step=9, skip_data=(12, 13), reason=reason, **common
        ),
    )
    await wait_state(bus, jid, "ROLLING_BACK")
    await bus.publish(
        subjects.incident(jid),
        IncidentRaised(
            event_id=iid,
            job_id=jid,
            attempt=1,
            kind="nan",
            action="rollback",
            step=12,
            rank=0,
            message=reason,
            evidence={"loss": None, "skipped": skipped, "checkpoint": path},
        ),
    )


async def _lifecycle_incident(bus: Bus, jid: str) -> IncidentRaised:
    event = await next_event(
        bus, subjects.incident(jid), lambda e: isinstance(e, IncidentRaised) and e.kind == "lifecycle"
    )
    assert isinstance(event, IncidentRaised)
    return event


async def test_a_rollback_the_ranks_outran_succeeds_when_the_bad_update_was_skipped(
    quick: Running, nodes, bus: Bus
) -> None:
    """Issue 32's order: rank 0's exit, the halt and rollback, then rank 1's exit; the update was skipped."""
    jid, launch, path = await _running(quick, nodes, bus)
    await exit_rank(bus, launch, 0, 0)
    await _nan_on_the_last_step(bus, jid, path, skipped=True)
    await exit_rank(bus, launch, 1, 0)  # was a Conflict (ROLLING_BACK -> SUCCEEDED), dead-lettered
    done = await wait_state(bus, jid, "SUCCEEDED")
    assert done.cause.startswith("the ranks finished before the rollback reached them")
    assert "never applied" in done.cause
    incident = await _lifecycle_incident(bus, jid)
    assert incident.action == "alert" and "never applied" in incident.message
    got = (await quick.http.get(f"/api/v1/jobs/{jid}")).json()
    assert [r["exit_code"] for r in got["ranks"]] == [0, 0]  # rank 1's exit is recorded now
    gpus = (await quick.http.get("/api/v1/gpus")).json()["items"]
    assert all(g["job_id"] is None for g in gpus)


async def test_a_rollback_the_ranks_outran_relaunches_from_its_checkpoint(
    quick: Running, nodes, bus: Bus
) -> None:
    """The same, but the bad update was applied: the next attempt starts from the rollback's checkpoint."""
    jid, launch, path = await _running(quick, nodes, bus)
    await exit_rank(bus, launch, 0, 0)
    await _nan_on_the_last_step(bus, jid, path, skipped=False)
    await exit_rank(bus, launch, 1, 0)
    relaunch = await launched(bus, jid, attempt=2)
    assert relaunch.resume_from == path and relaunch.skip_data == (12, 13)
    moved = await wait_state(bus, jid, "ROLLING_BACK", attempt=2)
    assert moved.cause == "restart from step 9: the ranks finished before the rollback reached them"
    await start_ranks(bus, relaunch)
    await wait_state(bus, jid, "RUNNING", attempt=2)
    await exit_rank(bus, relaunch, 0, 0)
    await exit_rank(bus, relaunch, 1, 0)
    await wait_state(bus, jid, "SUCCEEDED", attempt=2)


async def test_a_rank_whose_exit_is_never_reported_is_resolved_by_the_sweeper(
    quick: Running, nodes, bus: Bus
) -> None:
    jid, launch, path = await _running(quick, nodes, bus)
    await exit_rank(bus, launch, 0, 0)
    await _nan_on_the_last_step(bus, jid, path, skipped=True)
    # rank 1's exit never comes: after TRANSITION_TIMEOUT_S without progress the sweeper settles it
    async with bus.watch(subjects.cmd(jid), from_start=True) as commands:
        done = await wait_state(bus, jid, "SUCCEEDED", timeout_s=TRANSITION_TIMEOUT_S + 15)
        assert done.cause.startswith("rank 1's exit never reported"), done.cause
        while not isinstance(cmd := await commands.next(10), CancelJob):  # for a rank 1 still there
            assert cmd is not None, "no CancelJob for the rank whose exit never came"
    assert cmd.attempt == 1
    incident = await _lifecycle_incident(bus, jid)
    assert "rank 1's exit never reported" in incident.message
    gpus = (await quick.http.get("/api/v1/gpus")).json()["items"]
    assert all(g["job_id"] is None for g in gpus)


async def test_a_rank_whose_exit_is_never_reported_relaunches_when_the_update_was_applied(
    quick: Running, nodes, bus: Bus
) -> None:
    jid, launch, path = await _running(quick, nodes, bus)
    await exit_rank(bus, launch, 0, 0)
    await _nan_on_the_last_step(bus, jid, path, skipped=False)
    relaunch = await launched(bus, jid, attempt=2, timeout_s=TRANSITION_TIMEOUT_S + 15)
    assert relaunch.resume_from == path
    moved = await wait_state(bus, jid, "ROLLING_BACK", attempt=2)
    assert "rank 1's exit never reported" in moved.cause
    incident = await _lifecycle_incident(bus, jid)
    assert (
        "rank 1's exit never reported" in incident.message and "relaunched as attempt 2" in incident.message
    )


async def test_ranks_that_never_start_are_requeued_by_the_sweeper(quick: Running, nodes, bus: Bus) -> None:
    node = nodes(slots=2)
    await node.beat()
    jid = (await quick.http.post("/api/v1/jobs", json=spec())).json()["id"]
    launch = await launched(bus, jid)
    await start_ranks(bus, launch.model_copy(update={"placement": launch.placement[:1]}))  # rank 0 only
    requeued = await wait_state(bus, jid, "PENDING", attempt=2, timeout_s=TRANSITION_TIMEOUT_S + 15)
    assert requeued.cause.startswith("attempt 1 was launched but rank 1's start never reported"), (
        requeued.cause
    )
    await launched(bus, jid, attempt=2)
