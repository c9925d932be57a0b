"""Warm ranks: when a taken one is replaced (on a CPU node, not while ranks run there unless the pool is
short of one relaunch of them; on a GPU node, at once), and a launched one runs as any process."""

from __future__ import annotations

import os
import resource
import subprocess
import sys
from types import SimpleNamespace
from typing import Any

import pytest

from vigil_common.settings import Settings
from vigil_worker.warm import WarmRanks


def pool(kind: str, standbys: int, running: list[int]) -> tuple[WarmRanks, list[Any]]:
    warm = WarmRanks(Settings(warm_ranks=standbys), kind, [0, 1], lambda: running[0])
    spawned: list[Any] = []
    warm._spawn = lambda device: (spawned.append(device), warm.standbys.append(SimpleNamespace()))  # type: ignore[method-assign]
    warm.standbys = [SimpleNamespace() for _ in range(standbys)]  # type: ignore[misc]
    return warm, spawned


def test_a_cpu_node_replaces_only_once_its_ranks_are_done_while_the_pool_covers_a_relaunch():
    running = [2]
    warm, spawned = pool("cpu", 2, running)  # 4 kept, 2 taken by a launch of 2 ranks
    warm.owed = [None, None]
    warm.refill()
    assert spawned == []  # 2 left cover a relaunch of the 2 that run: their imports would slow them
    running[0] = 0
    warm.refill()  # the job's ranks are done
    assert spawned == [None, None] and warm.owed == []


def test_a_cpu_node_short_of_a_relaunch_replaces_at_once_and_a_gpu_node_always():
    running = [2]
    warm, spawned = pool("cpu", 0, running)
    warm.owed = [None, None]
    warm.refill()
    assert spawned == [None, None]  # two started: the pool covers a relaunch again
    warm, spawned = pool("gpu", 2, running)
    warm.owed = [0, 1]
    warm.refill()
    assert spawned == [0, 1]


def test_a_warm_rank_launched_runs_every_thread_as_any_process():
    """A standby waits on idle cycles; the threads its imports started keep the policy they were made
    with, so the launch resets each of them, not the main thread alone."""
    code = (
        "import os, threading\n"
        "from vigil.handover import run_as_any_process\n"
        "from vigil_trainer.standby import wait_on_idle_cycles\n"
        "wait_on_idle_cycles()\n"
        "stop = threading.Event()\n"
        "threading.Thread(target=stop.wait, daemon=True).start()  # one its imports started\n"
        "tasks = lambda: [os.sched_getscheduler(int(t)) for t in os.listdir('/proc/self/task')]\n"
        "before = tasks()\n"
        "run_as_any_process()\n"
        "print(before, tasks())\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split("] [") == [
        f"[{os.SCHED_IDLE}, {os.SCHED_IDLE}",
        f"{os.SCHED_OTHER}, {os.SCHED_OTHER}]\n",
    ]


@pytest.mark.skipif(os.geteuid() != 0, reason="switches to another user: needs root")
def test_a_warm_rank_of_an_unprivileged_worker_imports_at_the_usual_priority():
    """A worker not run as root (its image's user, a pod) may not give a rank SCHED_OTHER back from
    SCHED_IDLE unless RLIMIT_NICE lets it: every launch failed with EPERM under compose. Such a standby
    imports at the usual priority, and its launch succeeds (as root it waits on idle cycles: above)."""
    code = (
        "import os\n"
        "from vigil.handover import run_as_any_process\n"
        "from vigil_trainer.standby import wait_on_idle_cycles\n"
        "wait_on_idle_cycles()\n"
        "waiting = os.sched_getscheduler(0)\n"
        "run_as_any_process()\n"
        "print(waiting, os.sched_getscheduler(0))\n"
    )

    def unprivileged() -> None:
        resource.setrlimit(resource.RLIMIT_NICE, (0, 0))  # as a container's user has it
        os.setgid(65534)
        os.setuid(65534)

    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, preexec_fn=unprivileged, cwd="/"
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == [str(os.SCHED_OTHER), str(os.SCHED_OTHER)]
