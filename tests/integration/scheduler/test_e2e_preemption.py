"""Spot preemption with a real scheduler, two real workers and real DeepSpeed ranks: a preemption notice
(the cloud's notice file, or SIGTERM to the worker) makes the ranks write an emergency checkpoint at the
next step boundary and exit `preempted`; the job is requeued on the other worker without counting
against VIGIL_MAX_ATTEMPTS (1 here), resumes from the emergency checkpoint and loses at most one step."""

from __future__ import annotations

import asyncio
import contextlib
import json
import signal
import subprocess
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import httpx
import pytest

from vigil.events import CheckpointSaved, NodeHeartbeat, RankExited, StepCompleted
from vigil_common import subjects
from vigil_common.bus import Bus
from vigil_common.db import create_pool
from vigil_scheduler.main import run

from .conftest import (
    TOKEN,
    Running,
    count_on,
    launched,
    next_event,
    scheduler_settings,
    wait_ready,
    wait_state,
)
from .test_e2e_failover import kill_our_rank
from .test_e2e_failover import start_worker as start_failover_worker

pytestmark = [pytest.mark.integration, pytest.mark.slow]


@pytest.fixture
async def one_attempt_scheduler(db_url: str, nats_url: str, tmp_path: Path) -> AsyncIterator[Running]:
    """A scheduler that allows one attempt: only a preemption's requeue may start a second."""
    settings = scheduler_settings(db_url, nats_url, tmp_path / "scheduler", max_attempts=1)
    base = f"http://{settings.http_host}:{settings.http_port}"
    stop = asyncio.Event()
    task = asyncio.create_task(run(settings, stop))
    pool = await create_pool(db_url, max_size=2)
    try:
        await wait_ready(base, task=task)
        async with httpx.AsyncClient(
            base_url=base,
            headers={"Authorization": f"Bearer {TOKEN}"},
            timeout=10,
        ) as http:
            yield Running(settings, http, pool)
    finally:
        stop.set()
        await asyncio.wait_for(task, timeout=20)
        await pool.close()


def start_worker(nats_url: str, data_dir: Path, node: str) -> subprocess.Popen[bytes]:
    """A worker on spot terms: SIGTERM or its notice file is a preemption notice."""
    return start_failover_worker(
        nats_url,
        data_dir,
        node,
        cpu_slots=2,
        VIGIL_PREEMPT_ON_SIGTERM="true",
        VIGIL_PREEMPTION_NOTICE_FILE=str(data_dir / f"notice-{node}"),
        VIGIL_PREEMPTION_GRACE_S="60",
    )


@pytest.fixture
def workers(nats_url: str, tmp_path: Path) -> Iterator[dict[str, subprocess.Popen[bytes]]]:
    tag = uuid.uuid4().hex[:6]
    procs = {f"p-{tag}-{x}": start_worker(nats_url, tmp_path, f"p-{tag}-{x}") for x in "ab"}
    try:
        yield procs
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.send_signal(signal.SIGINT)  # a plain stop (SIGTERM would be a preemption notice)
                with contextlib.suppress(subprocess.TimeoutExpired):
                    proc.wait(20)
                if proc.poll() is None:
                    proc.kill()
        for state in tmp_path.glob("worker/*/ranks.json"):
            for r in json.loads(state.read_text()).get("ranks", []):
                kill_our_rank(r["pid"], tmp_path)


@pytest.mark.parametrize("notice", ["file", "sigterm"])
async def test_preempted_job_resumes_elsewhere_from_the_emergency_checkpoint(
    one_attempt_scheduler, workers, bus: Bus, tmp_path: Path, notice: str
) -> None:
    scheduler = one_attempt_scheduler
    for node in workers:
        await next_event(bus, subjects.heartbeat(node), lambda e: isinstance(e, NodeHeartbeat), timeout_s=60)
    spec = {
        "name": "e2e-preempt",
        "resources": {"nodes": 1, "gpus_per_node": 2},
        "model": {"preset": "tiny", "n_layer": 2, "seq_len": 32},
        "train": {"steps": 14, "micro_batch": 4, "lr": 3e-3, "warmup_steps": 1, "zero_stage": 1},
        "checkpoint": {"every": 1000},  # only step 0's and the emergency checkpoint
        "faults": [{"kind": "slow_rank", "step": 0, "delay_s": 0.3}],  # time to preempt it mid-run
    }
    jid = (await scheduler.http.post("/api/v1/jobs", json=spec)).json()["id"]
    first = await launched(bus, jid)
    victim = first.placement[0].node
    survivor = next(n for n in workers if n != victim)
    assert {p.node for p in first.placement} == {victim}
    await next_event(
        bus, subjects.job_steps(jid), lambda e: isinstance(e, StepCompleted) and e.step >= 3, timeout_s=120
    )

    t0 = time.monotonic()
    if notice == "file":
        (tmp_path / f"notice-{victim}").touch()
    else:
        workers[victim].send_signal(signal.SIGTERM)
    emergency = await next_event(
        bus, subjects.job_status(jid), lambda e: isinstance(e, CheckpointSaved) and e.step > 0, timeout_s=60
    )
    checkpointed_s = time.monotonic() - t0
    exited = await next_event(
        bus, subjects.job_status(jid), lambda e: isinstance(e, RankExited) and e.attempt == 1, timeout_s=60
    )
    assert exited.failure == "preempted" and exited.exit_code == 4, exited.log_tail

    second = await launched(bus, jid, attempt=2, timeout_s=60)
    assert {p.node for p in second.placement} == {survivor}, "requeued on other devices"
    assert second.resume_from == emergency.path
    first_steps = [e.step for e in await steps_of(bus, jid, attempt=1)]
    # at most one step of work lost: the checkpoint holds every step the first attempt finished
    assert emergency.step == max(first_steps) + 1
    resumed = await next_event(
        bus, subjects.job_steps(jid), lambda e: isinstance(e, StepCompleted) and e.attempt == 2, timeout_s=120
    )
    assert resumed.step == emergency.step and resumed.node == survivor
    done = await wait_state(bus, jid, "SUCCEEDED", timeout_s=180)
    total_s = time.monotonic() - t0
    assert done.attempt == 2, "the preempted attempt did not count against max_attempts=1"
    got = (await scheduler.http.get(f"/api/v1/jobs/{jid}")).json()
    assert any(t["cause"].startswith("preempted: ") for t in got["transitions"]), got["transitions"]
    assert workers[victim].wait(30) == 0, "the preempted worker stops once its ranks are out"
    print(
        f"preemption ({notice}): notice to emergency checkpoint of step {emergency.step} {checkpointed_s:.1f}s, "
        f"notice to SUCCEEDED on {survivor} {total_s:.1f}s"
    )


async def steps_of(bus: Bus, job_id: str, attempt: int) -> list[StepCompleted]:
    """Every StepCompleted of one attempt that the stream holds now."""
    n = await count_on(bus, subjects.JOBS.name, subjects.job_steps(job_id))
    found: list[StepCompleted] = []
    async with bus.watch(subjects.job_steps(job_id), from_start=True) as events:
        for _ in range(n):
            e = await asyncio.wait_for(anext(events), 15)
            if isinstance(e, StepCompleted) and e.attempt == attempt:
                found.append(e)
    return found
