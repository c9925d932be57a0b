"""Two real workers on this machine, real DeepSpeed ranks: killing the worker (and its ranks, as when a
machine dies) fails the job over to the other worker, which resumes from the last checkpoint."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from vigil.events import CheckpointSaved, NodeHeartbeat, RankStarted, StepCompleted
from vigil_common import subjects
from vigil_common.bus import Bus

from .conftest import launched, next_event, wait_state

pytestmark = [pytest.mark.integration, pytest.mark.slow]


def start_worker(
    nats_url: str, data_dir: Path, node: str, *, cpu_slots: int = 1, **settings: str
) -> subprocess.Popen[bytes]:
    """`vigil worker` as its own process; `settings`: more environment (VIGIL_... variables)."""
    env = dict(
        os.environ,
        VIGIL_NATS_URL=nats_url,
        VIGIL_DATA_DIR=str(data_dir),  # shared, as nodes share checkpoint storage
        VIGIL_NODE_NAME=node,
        VIGIL_CPU_SLOTS=str(cpu_slots),
        VIGIL_HEARTBEAT_INTERVAL_S="0.5",
        OMP_NUM_THREADS="1",
        **settings,
    )
    with (data_dir / f"worker-{node}.log").open("ab") as out:
        return subprocess.Popen(
            [str(Path(sys.executable).parent / "vigil"), "worker"],
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
        )


@pytest.fixture
def workers(nats_url: str, tmp_path: Path) -> Iterator[dict[str, subprocess.Popen[bytes]]]:
    tag = uuid.uuid4().hex[:6]
    procs = {f"w-{tag}-{x}": start_worker(nats_url, tmp_path, f"w-{tag}-{x}") for x in "ab"}
    rank_pids: list[int] = []
    try:
        yield procs
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.terminate()
                with contextlib.suppress(subprocess.TimeoutExpired):
                    proc.wait(20)
                if proc.poll() is None:
                    proc.kill()
        for state in tmp_path.glob("worker/*/ranks.json"):  # ranks outlive their worker by design
            rank_pids += [r["pid"] for r in json.loads(state.read_text()).get("ranks", [])]
        for pid in rank_pids:
            kill_our_rank(pid, tmp_path)


def kill_our_rank(pid: int, data_dir: Path) -> bool:
    """SIGKILL a rank's process group, only if that pid is still one of this test's ranks (a pid of a
    rank that ended may belong to someone else's process by now)."""
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace")
    except OSError:
        return False
    if "vigil_trainer" not in cmdline or str(data_dir) not in cmdline:
        return False
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, signal.SIGKILL)
    return True


async def test_killed_worker_fails_over_to_the_other_from_the_last_checkpoint(
    scheduler, workers, bus: Bus, tmp_path: Path
) -> None:
    for node in workers:
        await next_event(bus, subjects.heartbeat(node), lambda e: isinstance(e, NodeHeartbeat), timeout_s=60)
    spec = {
        "name": "e2e-failover",
        "resources": {"nodes": 1, "gpus_per_node": 1},
        "model": {"preset": "tiny", "n_layer": 2, "seq_len": 32},
        "train": {"steps": 16, "micro_batch": 4, "lr": 3e-3, "warmup_steps": 1, "zero_stage": 0},
        "checkpoint": {"every": 4},
        "faults": [{"kind": "slow_rank", "step": 0, "delay_s": 0.4}],  # time to kill it mid-run
    }
    job = (await scheduler.http.post("/api/v1/jobs", json=spec)).json()
    jid = job["id"]
    first = await launched(bus, jid)
    victim = first.placement[0].node
    survivor = next(n for n in workers if n != victim)
    started = await next_event(
        bus, subjects.job_status(jid), lambda e: isinstance(e, RankStarted), timeout_s=60
    )
    saved = await next_event(
        bus, subjects.job_status(jid), lambda e: isinstance(e, CheckpointSaved) and e.step >= 4, timeout_s=120
    )

    workers[victim].kill()  # the machine dies: worker and ranks at once
    workers[victim].wait(10)
    assert kill_our_rank(started.pid, tmp_path), "the rank was running on the victim"

    second = await launched(bus, jid, attempt=2, timeout_s=30)
    assert [p.node for p in second.placement] == [survivor]
    assert second.resume_from is not None
    resumed_step = int(Path(second.resume_from).name.removeprefix("step_"))
    assert resumed_step >= saved.step
    first_step = await next_event(
        bus, subjects.job_steps(jid), lambda e: isinstance(e, StepCompleted) and e.attempt == 2, timeout_s=120
    )
    assert first_step.step == resumed_step and first_step.node == survivor
    done = await wait_state(bus, jid, "SUCCEEDED", timeout_s=180)
    assert done.attempt == 2
    got = (await scheduler.http.get(f"/api/v1/jobs/{jid}")).json()
    causes = [t["cause"] for t in got["transitions"]]
    assert f"node {victim} lost (no heartbeat for 3 intervals)" in causes
