"""A warm rank: a built-in trainer process with its imports done (torch, DeepSpeed, the trainer's modules),
waiting on its stdin for a launch. A worker keeps some (`vigil_worker.warm`) so that a relaunch does not
spend seconds importing.

Until its launch it runs no job's code and holds nothing of any job: it was started by the worker with
the node's rank environment only (`launch.standby_env`: no job's variable, no secret). Its launch is one
JSON line (`Launch`); then it becomes the rank exactly as a started one would be: its output goes to the
rank's log, it joins the job's cgroup and drops to the job's user (`vigil.handover`), it takes the job's
environment and working folder, its token comes on a pipe named by `VIGIL_RANK_TOKEN_FD`, and it runs
`rank.main` with the trainer's arguments. The worker closing its end of stdin before a launch ends it.

`python -m vigil_trainer.standby` writes `READY` on stdout once warm.
"""

from __future__ import annotations

import json
import os
import resource
import sys
from typing import Any

from vigil.handover import READY, become_rank


def warm_up() -> None:
    """What a rank spends its first seconds on: the imports (nothing of a job runs)."""
    import deepspeed  # noqa: F401  (its accelerator from this process's DS_ACCELERATOR)
    import torch
    import torch._dynamo  # noqa: F401  (what DeepSpeed's engine imports on its first call: 2 s on a CPU)

    from vigil.integrations import ds_compat

    ds_compat.import_lazy_modules()  # what ZeRO's optimizer check imports (torch.compile, inductor)

    import vigil.run  # noqa: F401
    import vigil_trainer.checkpoint_collective
    import vigil_trainer.loop
    import vigil_trainer.model
    import vigil_trainer.rank  # noqa: F401


def may_leave_idle_cycles() -> bool:
    """Whether this process may give its threads the usual policy back at its launch: as root, or where
    RLIMIT_NICE lets an unprivileged process take nice 0 again (Linux: SCHED_IDLE -> SCHED_OTHER needs
    it). A worker not run as root (its image's `vigil` user, a pod) usually may not."""
    if os.geteuid() == 0:
        return True
    soft, _ = resource.getrlimit(resource.RLIMIT_NICE)
    return soft == resource.RLIM_INFINITY or soft >= 20


def wait_on_idle_cycles() -> None:
    """Import on idle cycles only (SCHED_IDLE): on a node whose cores its ranks keep busy, a warm rank's
    seconds of imports are not taken from them (the launch gives back the usual policy). Where the launch
    could not give it back (`may_leave_idle_cycles`), the rank would train on idle cycles, or its launch
    fail: it imports at the usual priority instead."""
    if not may_leave_idle_cycles():
        return
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
    from vigil_trainer.rank import main as rank_main

    sys.argv = [sys.argv[0], *launch["argv"]]
    return rank_main(launch["argv"])


if __name__ == "__main__":
    code = main()
    from vigil_trainer.rank import exit_process

    exit_process(code)
