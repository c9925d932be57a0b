"""Forging strikes: a user program reports two fake "transient" replays of its own device (the probe's
attack marked the device as silently corrupting; the job relaunched and did it again until every device
of the node was unhealthy and other jobs stayed PENDING).

Through the whole stack with real ranks: the reports are recorded, but a user program's word is evidence,
never a strike. The guardian asks the worker for its known-answer check of the device; the check passes;
no device is marked, the job is not relaunched, a victim job beside it trains on untouched, and a job that
needs every device of the node is placed once the hostile one is gone.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any

import pytest

from tests.helpers import eventually
from tests.integration.guardian.test_e2e_ranks import TINY, TRAIN, Stack, whole_stack
from vigil.events import (
    DeviceDiagnosed,
    DiagnoseDevice,
    IncidentRaised,
    JobStateChanged,
    LaunchJob,
    Message,
    RestartJob,
    StepCompleted,
    StepReplayed,
)
from vigil_common import subjects

pytestmark = [pytest.mark.integration, pytest.mark.security, pytest.mark.slow]

# The hostile program: rank 0 of its job, holding its rank token only (its one way to the bus, the relay).
FORGER = """
import time
import vigil
from vigil import events as ev

run = vigil.init()
me = run.identity
for step in (3, 4):  # two "transient" faults on its own device: sdc_strikes is 2
    run.emit(ev.StepReplayed(
        job_id=me.job_id, attempt=me.attempt, step=step, node=me.node, kind="nan", outcome="transient",
        culprits=[0], values=[ev.RankValue(rank=0, first=None, replay=2.0)], data_position=step, held_s=0.1,
    ))
run.close()  # sends what is queued
print("forged", flush=True)
time.sleep(600)  # holds its device, as a training job would, until cancelled
"""


@pytest.fixture(scope="module")
async def stack(
    nats_url: str, database_url: str, tmp_path_factory: pytest.TempPathFactory
) -> AsyncIterator[Stack]:
    code = tmp_path_factory.mktemp("code")
    (code / "forger.py").write_text(FORGER)
    data = tmp_path_factory.mktemp("forged-strikes")
    async with whole_stack(nats_url, database_url, data, "forge", cpu_slots=3, code_roots=[code]) as running:
        yield running


class Seen:
    """Every job's events the bus carried, in arrival order."""

    def __init__(self) -> None:
        self.events: list[Message] = []

    def of(self, job_id: str, cls: type[Message]) -> list[Any]:
        return [e for e in self.events if e.job_id == job_id and isinstance(e, cls)]

    def state(self, job_id: str) -> str | None:
        changes = self.of(job_id, JobStateChanged)
        return changes[-1].to_state if changes else None


@contextlib.asynccontextmanager
async def watching(stack: Stack) -> AsyncIterator[Seen]:
    seen = Seen()
    watched = (
        subjects.ALL_LAUNCHES,
        subjects.ALL_STEPS,
        subjects.ALL_STATUS,
        subjects.ALL_CMDS,
        subjects.ALL_INCIDENTS,
    )
    async with stack.bus.watch(*watched) as events:

        async def collect() -> None:
            async for e in events:
                seen.events.append(e)

        task = asyncio.create_task(collect())
        try:
            yield seen
        finally:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task


async def until(condition: Any, *, timeout: float = 30.0, what: str) -> Any:
    """`eventually` for a condition on the events seen so far (a plain function)."""

    async def check() -> Any:
        return condition()

    return await eventually(check, timeout=timeout, what=what)


async def submit(stack: Stack, spec: dict[str, Any]) -> str:
    response = await stack.http.post("/api/v1/jobs", json=spec)
    assert response.status_code == 201, response.text
    return response.json()["id"]


async def test_two_forged_transient_replays_mark_no_device_and_keep_no_job_pending(stack: Stack):
    async with watching(stack) as seen:
        victim = await submit(
            stack,
            {
                "name": "victim",
                "resources": {"nodes": 1, "gpus_per_node": 2},
                "model": TINY,
                "train": {**TRAIN, "steps": 8},
                "checkpoint": {"every": 4},
            },
        )
        await until(lambda: seen.state(victim) == "RUNNING", timeout=120, what="the victim running")
        forger = await submit(
            stack,
            {
                "name": "forger",
                "resources": {"nodes": 1, "gpus_per_node": 1},
                "entrypoint": {"argv": ["python", "forger.py"]},
                "train": {"steps": 10},
                "guardian": {"sdc_strikes": 2, "sdc": "rollback"},
            },
        )
        (diagnosed,) = await until(
            lambda: seen.of(forger, DeviceDiagnosed), timeout=120, what="the worker's check of the device"
        )
        (launch,) = seen.of(forger, LaunchJob)
        device = (launch.placement[0].node, launch.placement[0].device)
        assert (diagnosed.node, diagnosed.device, diagnosed.passed) == (*device, True), diagnosed
        assert set(diagnosed.checks) == {"matmul", "repeat", "reduce"}

        # the forged reports are on record, as the job's own word: no strike, one check asked
        assert [r.step for r in seen.of(forger, StepReplayed)] == [3, 4]
        (ask,) = seen.of(forger, DiagnoseDevice)
        assert (ask.node, ask.device) == device
        upheld = await until(
            lambda: [i for i in seen.of(forger, IncidentRaised) if "not upheld" in i.message],
            what="the alert that the report was not upheld",
        )
        assert upheld[0].action == "alert" and upheld[0].device is None
        replays = [i for i in seen.of(forger, IncidentRaised) if i.action == "replay"]
        assert len(replays) == 2 and all(i.evidence["vouched"] is False for i in replays)
        assert not [
            i
            for i in seen.events
            if isinstance(i, IncidentRaised) and i.kind == "sdc" and i.action != "alert"
        ]
        assert seen.of(forger, RestartJob) == []

        # no device is marked; the forger was not relaunched; the victim trains on, untouched
        gpus = (await stack.http.get("/api/v1/gpus")).json()["items"]
        assert [g for g in gpus if not g["healthy"]] == []
        assert await stack.pool.fetchval("SELECT count(*) FROM device_marks") == 0
        assert {launch.attempt for launch in seen.of(forger, LaunchJob)} == {1}
        await until(lambda: seen.state(victim) == "SUCCEEDED", timeout=240, what="the victim succeeded")
        assert {e.attempt for e in seen.of(victim, StepCompleted)} == {1}
        assert {e.step for e in seen.of(victim, StepCompleted)} == set(range(8))
        assert seen.of(victim, IncidentRaised) == [] and seen.of(victim, RestartJob) == []

        # once the forger is gone, a job that needs every device of the node is placed
        assert (await stack.http.post(f"/api/v1/jobs/{forger}/cancel")).status_code == 200
        whole = await submit(
            stack,
            {
                "name": "whole-node",
                "resources": {"nodes": 1, "gpus_per_node": 3},
                "model": TINY,
                "train": {**TRAIN, "steps": 2},
            },
        )
        await until(
            lambda: seen.state(whole) in ("SCHEDULED", "RUNNING", "SUCCEEDED"),
            timeout=60,
            what="the whole-node job placed",
        )
        assert (await stack.http.post(f"/api/v1/jobs/{whole}/cancel")).status_code in (200, 409)
