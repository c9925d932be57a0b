"""A warm rank: a built-in trainer process with its imports done (torch, DeepSpeed, the trainer's modules),
waiting on its stdin for a launch. A worker keeps some (`vigil_worker.warm`) so that a relaunch does not
spend seconds importing.

Until its launch it runs no job's code and holds nothing of any job: it was started by the worker with
the node's rank environment only (`launch.standby_env`: no job's variable, no secret). Its launch is one
JSON line (`Launch`); then it becomes the rank exactly as a started one would be: its output goes to the
rank's log, it joins the job's cgroup and drops to the job's user (`tenancy.become`), it takes the job's
environment and working folder, its token comes on a pipe named by `VIGIL_RANK_TOKEN_FD`, and it runs
`rank.main` with the trainer's arguments. The worker closing its end of stdin before a launch ends it.

`python -m vigil_worker.trainer.standby` writes `READY` on stdout once warm.
"""

from __future__ import annotations

import ctypes
import json
import os
import sys
from typing import Any, TypedDict

READY = b"vigil-warm-rank-ready\n"
PR_SET_DUMPABLE = 4


class Launch(TypedDict):
    argv: list[str]  # the trainer's arguments (after `-m vigil_worker.trainer`)
    env: dict[str, str]  # the rank's whole environment (`launch.rank_env`)
    cwd: str | None
    log: str  # the rank's log file
    token: str
    uid: int | None  # the job's user here (None: stay the worker's)
    gid: int | None
    cgroup: list[str]  # the job's cgroup.procs files


def warm_up() -> None:
    """What a rank spends its first seconds on: the imports (nothing of a job runs)."""
    import deepspeed  # noqa: F401  (its accelerator from this process's DS_ACCELERATOR)
    import torch
    import torch._dynamo  # noqa: F401  (what DeepSpeed's engine imports on its first call: 2 s on a CPU)

    from vigil.integrations import ds_compat

    ds_compat.import_lazy_modules()  # what ZeRO's optimizer check imports (torch.compile, inductor)

    import vigil.run  # noqa: F401
    import vigil_common.settings  # noqa: F401
    import vigil_worker.trainer.checkpoint_collective
    import vigil_worker.trainer.loop
    import vigil_worker.trainer.model
    import vigil_worker.trainer.rank  # noqa: F401


def become_rank(launch: Launch, log: int | None = None) -> None:
    """Take on the launched rank's output (`log`: its descriptor, already open), cgroup, user, environment,
    folder and token."""
    from vigil import protocol as proto
    from vigil_worker.tenancy import become

    if log is None:
        log = os.open(launch["log"], os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)  # as the worker's own
    os.dup2(log, 1)
    os.dup2(log, 2)
    os.close(log)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    run_as_any_process()
    read_end, write_end = os.pipe()  # the token, as a started rank finds it: on a descriptor
    os.write(write_end, launch["token"].encode())
    os.close(write_end)
    if launch["cwd"]:
        os.chdir(launch["cwd"])
    become(launch["uid"], launch["gid"], launch["cgroup"])
    if launch["uid"] is not None:  # a uid change made it undumpable: /proc/self is then root's
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_DUMPABLE, 1, 0, 0, 0)
    os.environ.clear()
    os.environ.update(launch["env"])
    os.environ[proto.RANK_TOKEN_FD_ENV] = str(read_end)
    if threads := launch["env"].get("OMP_NUM_THREADS"):
        import torch

        torch.set_num_threads(max(1, int(threads)))


def run_as_any_process() -> None:
    """It waited on idle cycles (SCHED_IDLE) or at a low priority; a rank runs as any process does. Every
    thread: those its imports started (torch's intra-op pool) kept the policy they were made with, and
    a rank's threads on idle cycles ran its steps at the pace of whatever else the node was doing."""
    try:
        threads = [int(t) for t in os.listdir("/proc/self/task")]
    except OSError:  # not Linux
        threads = [0]
    for tid in threads:
        try:
            if hasattr(os, "sched_setscheduler"):
                os.sched_setscheduler(tid, os.SCHED_OTHER, os.sched_param(0))
            os.setpriority(os.PRIO_PROCESS, tid, 0)
        except ProcessLookupError:  # a thread that ended meanwhile
            continue


def wait_on_idle_cycles() -> None:
    """Import on idle cycles only (SCHED_IDLE): on a node whose cores its ranks keep busy, a warm rank's
    seconds of imports are not taken from them (the launch gives back the usual policy)."""
    try:
        os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
    except (AttributeError, OSError):  # not Linux: a low priority instead
        os.nice(10)


def main() -> int:
    wait_on_idle_cycles()
    warm_up()
    os.write(1, READY)
    line = sys.stdin.buffer.readline()
    if not line.strip():  # let go before a launch
        return 0
    launch: Any = json.loads(line)
    become_rank(launch)
    from vigil_worker.trainer.rank import main as rank_main

    sys.argv = [sys.argv[0], *launch["argv"]]
    return rank_main(launch["argv"])


if __name__ == "__main__":
    code = main()
    from vigil_worker.trainer.rank import exit_process

    exit_process(code)
