"""The audit record: submit and cancel through the API name the token's fingerprint, halt, rollback and
restart seen on the bus name the publishing service; the record is readable as a page and cannot be changed."""

from __future__ import annotations

import asyncpg
import pytest

from tests.helpers import eventually
from vigil.events import HaltJob, RestartJob, RollbackJob
from vigil_common import subjects
from vigil_common.bus import Bus
from vigil_scheduler.audit import token_actor

from .conftest import TOKEN, spec

pytestmark = pytest.mark.integration


async def test_submit_cancel_halt_rollback_are_recorded_with_who_asked(scheduler, nats_url: str) -> None:
    job = (await scheduler.http.post("/api/v1/jobs", json=spec(per_node=64))).json()["id"]
    guardian = await Bus.connect(nats_url, "guardian")  # as the guardian service names its connection
    try:
        halt = HaltJob(job_id=job, attempt=1, reason="nan at step 7")
        await guardian.publish(subjects.cmd(job), halt)
        await guardian.publish(subjects.cmd(job), halt)  # a duplicate is one record
        await guardian.publish(
            subjects.cmd(job), RollbackJob(job_id=job, attempt=1, reason="nan", step=5, checkpoint="/ckpt/5")
        )
        # a relaunch is recorded as what it is, not as a rollback
        restart = RestartJob(job_id=job, attempt=1, reason="hang", step=5, checkpoint="/ckpt/5")
        await guardian.publish(subjects.cmd(job), restart)
    finally:
        await guardian.close()

    async def recorded() -> list[dict]:
        items = (await scheduler.http.get("/api/v1/audit", params={"job_id": job})).json()["items"]
        return items if len(items) >= 4 else []

    await eventually(recorded, what="submit, halt, rollback and restart in the audit record")
    assert (await scheduler.http.post(f"/api/v1/jobs/{job}/cancel")).status_code == 200
    items = (await scheduler.http.get("/api/v1/audit", params={"job_id": job, "limit": 2})).json()
    rest = (await scheduler.http.get("/api/v1/audit", params={"job_id": job, "cursor": items["next"]})).json()
    records = items["items"] + rest["items"]  # newest first, two pages
    assert [(r["action"], r["actor"]) for r in records] == [
        ("cancel", token_actor(TOKEN)),
        ("restart", "service:guardian"),
        ("rollback", "service:guardian"),
        ("halt", "service:guardian"),
        ("submit", token_actor(TOKEN)),
    ]
    assert TOKEN not in str(records) and records[3]["detail"]["reason"] == "nan at step 7"
    # the scheduler's own CancelJob on the bus is not a second cancel record
    assert rest["next"] is None
    assert (
        await scheduler.http.get("/api/v1/audit", headers={"Authorization": "Bearer nope"})
    ).status_code == 401


async def test_the_audit_record_is_append_only(pool) -> None:
    await pool.execute("INSERT INTO audit_log (action, actor, job_id) VALUES ('submit', 'test', 'j-audit')")
    for sql in (
        "UPDATE audit_log SET actor = 'someone else' WHERE job_id = 'j-audit'",
        "DELETE FROM audit_log WHERE job_id = 'j-audit'",
        "TRUNCATE audit_log",
    ):
        with pytest.raises(asyncpg.InsufficientPrivilegeError, match="append-only"):
            await pool.execute(sql)
