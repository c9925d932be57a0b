"""Issue 41 §1-2 with a real scheduler, a real worker and real ranks (the built-in trainer, a tiny model on
CPU): a job of higher priority preempts a running one without lost work, and an attempt past its time
limit is ended after its emergency checkpoint."""

from __future__ import annotations

import contextlib
import json
import signal
import subprocess
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest

from vigil.events import CheckpointSaved, IncidentRaised, NodeHeartbeat, PreemptJob, RankExited, StepCompleted
from vigil_common import subjects
from vigil_common.bus import Bus

from .conftest import Running, count_on, launched, next_event, running, scheduler_settings, wait_state
from .test_e2e_failover import kill_our_rank
from .test_e2e_failover import start_worker as start_failover_worker
from .test_e2e_preemption import steps_of

pytestmark = [pytest.mark.integration, pytest.mark.slow]

STEPS = 12
TRAIN: dict[str, Any] = {"steps": STEPS, "micro_batch": 4, "lr": 3e-3, "warmup_steps": 1, "seed": 7}
MODEL = {"preset": "tiny", "n_layer": 1, "seq_len": 32}


def job(name: str, priority: int, **extra: Any) -> dict[str, Any]:
    return {
        "name": name,
        "priority": priority,
        "resources": {"nodes": 1, "gpus_per_node": 1},
        "model": MODEL,
        "train": TRAIN,
        "checkpoint": {"every": 1000},  # only step 0's and the emergency checkpoint
        **extra,
    }


@pytest.fixture
async def scheduler(db_url: str, nats_url: str, tmp_path: Path) -> AsyncIterator[Running]:
    """One attempt allowed (only a preemption's requeue may start a second); the sweeper looks every
    second (a quarter of the transition timeout) for attempts past their time limit."""
    settings = scheduler_settings(
        db_url, nats_url, tmp_path / "scheduler", max_attempts=1, transition_timeout_s=4.0
    )
    async with running(settings) as started:
        yield started


@pytest.fixture
def worker(nats_url: str, tmp_path: Path) -> Iterator[str]:
    """One node with one CPU slot: a second job fits only in the place of the first."""
    node = f"pp-{uuid.uuid4().hex[:6]}"
    proc = start_failover_worker(nats_url, tmp_path, node, cpu_slots=1, VIGIL_PREEMPTION_GRACE_S="60")
    try:
        yield node
    finally:
        proc.send_signal(signal.SIGINT)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(20)
        if proc.poll() is None:
            proc.kill()
        for state in tmp_path.glob("worker/*/ranks.json"):
            for r in json.loads(state.read_text()).get("ranks", []):
                kill_our_rank(r["pid"], tmp_path)


async def test_a_higher_priority_job_preempts_a_running_one_which_resumes_with_no_step_redone(
    scheduler: Running, worker: str, bus: Bus
) -> None:
    await next_event(bus, subjects.heartbeat(worker), lambda e: isinstance(e, NodeHeartbeat), timeout_s=60)
    slow = [{"kind": "slow_rank", "step": 0, "delay_s": 0.4}]  # time to preempt it mid-run
    low = (await scheduler.http.post("/api/v1/jobs", json=job("low", 10, faults=slow))).json()["id"]
    first = await launched(bus, low)
    await next_event(
        bus, subjects.job_steps(low), lambda e: isinstance(e, StepCompleted) and e.step >= 1, timeout_s=120
    )
    # the same training, uninterrupted: the reference for the victim's losses
    high = (await scheduler.http.post("/api/v1/jobs", json=job("high", 50))).json()["id"]

    notice = await next_event(bus, subjects.cmd(low), lambda e: isinstance(e, PreemptJob), timeout_s=30)
    assert isinstance(notice, PreemptJob) and (notice.kind, notice.by_job, notice.attempt) == (
        "preempt",
        high,
        1,
    )
    assert notice.reason == f"preempted by {high} (priority 50 > 10): needs 1 CPU slot", notice.reason
    emergency = await next_event(
        bus, subjects.job_status(low), lambda e: isinstance(e, CheckpointSaved) and e.step > 0, timeout_s=60
    )
    exited = await next_event(
        bus, subjects.job_status(low), lambda e: isinstance(e, RankExited), timeout_s=60
    )
    assert exited.failure == "preempted" and exited.exit_code == 4, exited.log_tail

    taken = await launched(bus, high, timeout_s=30)  # the preemptor gets the victim's device
    assert [(p.node, p.device) for p in taken.placement] == [(p.node, p.device) for p in first.placement]
    await wait_state(bus, high, "SUCCEEDED", timeout_s=120)
    second = await launched(bus, low, attempt=2, timeout_s=60)
    assert second.resume_from == emergency.path
    await wait_state(bus, low, "SUCCEEDED", timeout_s=120)

    before = {e.step: e.loss for e in await steps_of(bus, low, attempt=1)}
    after = {e.step: e.loss for e in await steps_of(bus, low, attempt=2)}
    assert min(after) == emergency.step == max(before) + 1, "it resumes at the step it stopped at"
    assert not before.keys() & after.keys(), "0 steps redone"
    losses = before | after
    reference = {e.step: e.loss for e in await steps_of(bus, high, attempt=1)}
    assert sorted(losses) == sorted(reference) == list(range(STEPS))
    assert losses == pytest.approx(reference, rel=1e-5), "its losses are an uninterrupted run's"

    got = (await scheduler.http.get(f"/api/v1/jobs/{low}")).json()
    causes = [t["cause"] for t in got["transitions"]]
    assert any(c.startswith(f"preempted by {high} (priority 50 > 10)") for c in causes), causes
    assert got["attempt"] == 2, "the preempted attempt did not count against max_attempts=1"
    incident = await next_event(bus, subjects.incident(low), lambda e: isinstance(e, IncidentRaised))
    assert incident.kind == "preemption" and incident.evidence["by_job"] == high
    # one preemption in flight: the passes that ran before the victim exited sent no second notice
    assert await count_on(bus, subjects.COMMANDS.name, subjects.cmd(low)) == 1
    audit = await scheduler.pool.fetch("SELECT action, actor, detail FROM audit_log WHERE job_id = $1", low)
    preempted = [r for r in audit if r["action"] == "preempt"]
    assert len(preempted) == 1 and json.loads(preempted[0]["detail"])["by_job"] == high, audit


async def test_an_attempt_past_its_time_limit_checkpoints_and_the_job_ends_naming_the_limit(
    scheduler: Running, worker: str, bus: Bus
) -> None:
    await next_event(bus, subjects.heartbeat(worker), lambda e: isinstance(e, NodeHeartbeat), timeout_s=60)
    slow = [{"kind": "slow_rank", "step": 0, "delay_s": 0.5}]  # it cannot finish within its limit
    spec = job("limited", 0, faults=slow, scheduling={"time_limit": "4s"})
    jid = (await scheduler.http.post("/api/v1/jobs", json=spec)).json()["id"]
    started = await next_event(bus, subjects.job_steps(jid), lambda e: isinstance(e, StepCompleted), 120)
    t0 = time.monotonic()
    notice = await next_event(bus, subjects.cmd(jid), lambda e: isinstance(e, PreemptJob), timeout_s=30)
    assert notice.kind == "time_limit" and "time limit 4s (scheduling.time_limit)" in notice.reason
    emergency = await next_event(
        bus, subjects.job_status(jid), lambda e: isinstance(e, CheckpointSaved) and e.step > 0, timeout_s=60
    )
    failed = await wait_state(bus, jid, "FAILED", timeout_s=60)
    print(f"time limit: first step to FAILED {time.monotonic() - t0:.1f}s (step {started.step} first)")
    assert f"emergency checkpoint of step {emergency.step}: {emergency.path}" in failed.cause, failed.cause
    assert failed.cause.startswith("time limit 4s (scheduling.time_limit) reached by attempt 1"), failed.cause
    assert failed.attempt == 1, "ended, not requeued"
    ran = [e.step for e in await steps_of(bus, jid, attempt=1)]
    assert max(ran) + 1 == emergency.step < STEPS, "stopped mid-run, its every finished step checkpointed"
