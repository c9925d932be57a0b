"""The job state machine driven by the events workers and the guardian publish."""

from __future__ import annotations

from datetime import UTC, datetime

import pytest

from tests.helpers import eventually
from vigil.events import (
    CancelJob,
    HaltJob,
    IncidentRaised,
    RestartJob,
    ResumeJob,
    RollbackCompleted,
    RollbackJob,
)
from vigil_common import subjects
from vigil_common.bus import Bus

from .conftest import checkpoint, exit_rank, launched, spec, start_ranks, wait_state

pytestmark = pytest.mark.integration


async def test_ranks_started_then_all_exit_zero_succeeds_and_frees(scheduler, nodes, bus: Bus) -> None:
    node = nodes(slots=2)
    await node.beat()
    job = (await scheduler.http.post("/api/v1/jobs", json=spec())).json()
    launch = await launched(bus, job["id"])
    await start_ranks(bus, launch)
    await wait_state(bus, job["id"], "RUNNING")
    await exit_rank(bus, launch, 0, 0)
    await exit_rank(bus, launch, 1, 0)
    done = await wait_state(bus, job["id"], "SUCCEEDED")
    assert done.cause == "all 2 ranks exited 0"
    gpus = (await scheduler.http.get("/api/v1/gpus")).json()["items"]
    assert all(g["job_id"] is None for g in gpus)
    got = (await scheduler.http.get(f"/api/v1/jobs/{job['id']}")).json()
    assert [r["exit_code"] for r in got["ranks"]] == [0, 0] and got["finished_at"]


async def test_rank_failure_requeues_from_newest_checkpoint_until_attempts_run_out(
    scheduler, nodes, bus: Bus
) -> None:
    node = nodes(slots=2)
    await node.beat()
    job = (await scheduler.http.post("/api/v1/jobs", json=spec())).json()
    first = await launched(bus, job["id"])
    await start_ranks(bus, first)
    await wait_state(bus, job["id"], "RUNNING")
    node.busy = {0, 1}  # the worker reports the old ranks still running: the job may reuse its own devices
    await node.beat()
    await checkpoint(bus, job["id"], 1, 4, node.name)
    newest = await checkpoint(bus, job["id"], 1, 9, node.name)
    await exit_rank(bus, first, 1, 3)

    second = await launched(bus, job["id"], attempt=2)
    assert second.resume_from == newest
    assert {(p.node, p.device) for p in second.placement} == {(node.name, 0), (node.name, 1)}
    requeued = await wait_state(bus, job["id"], "PENDING", attempt=2)
    assert requeued.cause == f"rank 1 on {node.name} exited with code 3 (error)"
    await exit_rank(bus, first, 0, 1)  # the old attempt's other rank: stale, changes nothing
    await start_ranks(bus, second)
    await wait_state(bus, job["id"], "RUNNING", attempt=2)
    await exit_rank(bus, second, 0, 7)

    third = await launched(bus, job["id"], attempt=3)
    await start_ranks(bus, third)
    await exit_rank(bus, third, 1, 9)
    failed = await wait_state(bus, job["id"], "FAILED")
    assert "no attempts left (3 of 3 used)" in failed.cause
    got = (await scheduler.http.get(f"/api/v1/jobs/{job['id']}")).json()
    assert got["state"] == "FAILED" and got["attempt"] == 3
    assert got["reason"] == f"rank 1 on {node.name} exited with code 9 (error)"
    attempts = [t["attempt"] for t in got["transitions"] if t["to_state"] == "SCHEDULED"]
    assert attempts == [1, 2, 3]
    assert [(a["attempt"], a["resume_from"]) for a in got["attempts"]] == [
        (1, None),
        (2, newest),
        (3, newest),
    ]
    assert got["attempts"][0]["ended"] == f"rank 1 on {node.name} exited with code 3 (error)"
    assert got["attempts"][2]["ended"].endswith("no attempts left (3 of 3 used)")
    gpus = (await scheduler.http.get("/api/v1/gpus")).json()["items"]
    assert all(g["job_id"] is None for g in gpus)


async def test_guardian_commands_drive_halt_rollback_restart_and_fail(scheduler, nodes, bus: Bus) -> None:
    node = nodes(slots=2)
    await node.beat()
    job = (await scheduler.http.post("/api/v1/jobs", json=spec())).json()
    jid = job["id"]
    first = await launched(bus, jid)
    await start_ranks(bus, first)
    await wait_state(bus, jid, "RUNNING")
    good = await checkpoint(bus, jid, 1, 19, node.name)
    await checkpoint(bus, jid, 1, 39, node.name)

    await bus.publish(subjects.cmd(jid), HaltJob(job_id=jid, attempt=1, reason="nan at step 42"))
    assert (await wait_state(bus, jid, "HALTED")).cause == "halted: nan at step 42"
    rollback = RollbackJob(job_id=jid, attempt=1, checkpoint=good, step=19, reason="nan at step 42")
    await bus.publish(subjects.cmd(jid), rollback)
    await wait_state(bus, jid, "ROLLING_BACK")
    await bus.publish(
        subjects.status(jid, node.name),
        RollbackCompleted(
            job_id=jid,
            attempt=1,
            from_step=42,
            to_step=19,
            checkpoint=good,
            command_id=rollback.event_id,
            duration_s=0.5,
            node=node.name,
        ),
    )
    await wait_state(bus, jid, "RUNNING", cause="rolled back from step 42 to 19")

    await bus.publish(subjects.cmd(jid), HaltJob(job_id=jid, attempt=1, reason="operator"))
    await wait_state(bus, jid, "HALTED", cause="halted: operator")
    await bus.publish(subjects.cmd(jid), ResumeJob(job_id=jid, attempt=1, reason="looked fine"))
    await wait_state(bus, jid, "RUNNING", cause="resumed: looked fine")

    # Hung ranks cannot roll back in place: a restart is a new attempt from the checkpoint. The step-39
    # checkpoint was superseded by the rollback to 19, so nothing newer than 19 is offered.
    await bus.publish(
        subjects.cmd(jid),
        RestartJob(job_id=jid, attempt=1, checkpoint=good, step=19, skip_data=(20, 22), reason="hang"),
    )
    second = await launched(bus, jid, attempt=2)
    assert second.resume_from == good and second.skip_data == (20, 22)
    assert (await wait_state(bus, jid, "ROLLING_BACK", attempt=2)).cause == "restart from step 19: hang"
    await start_ranks(bus, second)
    await wait_state(bus, jid, "RUNNING", attempt=2)

    await bus.publish(
        subjects.incident(jid),
        IncidentRaised(
            job_id=jid, attempt=2, kind="divergence", action="fail", message="max rollbacks exceeded"
        ),
    )
    async with bus.watch(subjects.cmd(jid), from_start=True) as commands:
        failed = await wait_state(bus, jid, "FAILED")
        assert failed.cause == "divergence: max rollbacks exceeded"
        # the scheduler, not the guardian, tells the workers to end the failed job's ranks
        while not isinstance(cmd := await commands.next(10), CancelJob):
            assert cmd is not None, "no CancelJob after FAILED"
    assert cmd.attempt == 2 and "max rollbacks exceeded" in cmd.reason


async def test_unhealthy_devices_are_never_placed_on(scheduler, nodes, bus: Bus) -> None:
    node = nodes(slots=3, sick={2})
    await node.beat()
    await bus.publish(
        subjects.incident("fleet"),
        IncidentRaised(
            job_id="fleet",
            kind="gpu_health",
            action="alert",
            node=node.name,
            device=0,
            message="xid 79: fell off the bus",
        ),
    )

    async def marked() -> bool:
        gpus = (await scheduler.http.get("/api/v1/gpus")).json()["items"]
        return any(g["index"] == 0 and g["node"] == node.name and not g["healthy"] for g in gpus)

    await eventually(marked, what="device 0 marked unhealthy")
    big = (await scheduler.http.post("/api/v1/jobs", json=spec("big", per_node=2))).json()
    small = (await scheduler.http.post("/api/v1/jobs", json=spec("small", per_node=1, priority=-1))).json()
    launch = await launched(bus, small["id"])
    assert [(p.node, p.device) for p in launch.placement] == [(node.name, 1)]
    gpus = {g["index"]: g for g in (await scheduler.http.get("/api/v1/gpus")).json()["items"]}
    assert not gpus[0]["healthy"] and gpus[0]["unhealthy_reason"] == "xid 79: fell off the bus"
    assert not gpus[2]["healthy"] and gpus[1]["healthy"]
    # The big job cannot ever fit on healthy devices, so it blocks nobody and waits.
    assert (await scheduler.http.get(f"/api/v1/jobs/{big['id']}")).json()["state"] == "PENDING"


async def test_priority_then_submission_order(scheduler, nodes, bus: Bus) -> None:
    node = nodes(slots=2)
    await node.beat()
    running = (await scheduler.http.post("/api/v1/jobs", json=spec("running"))).json()
    await wait_state(bus, running["id"], "SCHEDULED")
    low = (await scheduler.http.post("/api/v1/jobs", json=spec("low"))).json()
    high = (await scheduler.http.post("/api/v1/jobs", json=spec("high", priority=5))).json()
    await scheduler.http.post(f"/api/v1/jobs/{running['id']}/cancel")
    await launched(bus, high["id"])
    assert (await scheduler.http.get(f"/api/v1/jobs/{low['id']}")).json()["state"] == "PENDING"


async def test_a_rank_killed_because_its_sibling_died_is_not_the_cause(scheduler, nodes, bus: Bus) -> None:
    node = nodes(slots=2)
    await node.beat()
    job = (await scheduler.http.post("/api/v1/jobs", json=spec())).json()
    first = await launched(bus, job["id"])
    await start_ranks(bus, first)
    await exit_rank(bus, first, 0, None, failure="killed_by_vigil")  # reported before the rank that died
    await exit_rank(bus, first, 1, 3)
    requeued = await wait_state(bus, job["id"], "PENDING", attempt=2)
    assert requeued.cause == f"rank 1 on {node.name} exited with code 3 (error)"


async def test_a_restarted_worker_that_reports_free_devices_requeues_its_running_job(
    scheduler, nodes, bus: Bus
) -> None:
    node = nodes(slots=2)
    await node.beat()
    job = (await scheduler.http.post("/api/v1/jobs", json=spec())).json()
    await start_ranks(bus, await launched(bus, job["id"]))
    node.busy = {0, 1}
    await wait_state(bus, job["id"], "RUNNING")
    node.started_at = datetime.now(UTC)  # a new worker process: its ranks are gone, its devices free
    node.busy = set()
    requeued = await wait_state(bus, job["id"], "PENDING", attempt=2)
    assert requeued.cause == f"the worker on node {node.name} restarted; its ranks are gone"
