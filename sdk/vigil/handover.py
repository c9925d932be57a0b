"""A rank process handed its rank by its worker, rather than started as it: the one owner of that protocol.

Two kinds of process wait to be handed a rank, both the built-in trainer's (`vigil_trainer`):
- a warm rank (`vigil_trainer.standby`), started by the worker with its imports done, writes `READY` on
  its stdout and reads its `Launch` as one JSON line on its stdin;
- a parked rank (`vigil_trainer.park`), a survivor whose collective failed, listens on `next_socket`
  beside its exit file and writes `parked_marker` there; the worker connects and hands it its job's next
  attempt (a `Launch` and the new log's descriptor). Only a worker that allows it sets `PARK_ENV`. While
  it trains, such a rank also listens on `cut_socket`: a survivor whose collective waits on a peer that is
  cut off (no connection closed) is told so by its worker, cuts its connections, and parks.

Either way the process then becomes the rank exactly as a started one would be (`become_rank`): its
output goes to the rank's log, it joins the job's cgroup and drops to the job's user (`become`, which a
started rank's child runs between fork and exec too), it takes the job's environment and working folder,
and its token comes on a pipe named by `VIGIL_RANK_TOKEN_FD`.
"""

from __future__ import annotations

import ctypes
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any, TypedDict

from vigil import protocol as proto

READY = b"vigil-warm-rank-ready\n"  # a warm rank's line on its stdout once its imports are done
PARK_ENV = "VIGIL_PARK"  # "1": the worker hands this rank its job's next attempt when it fails a collective
PR_SET_DUMPABLE = 4
PR_SET_NO_NEW_PRIVS = 38


class Launch(TypedDict):
    argv: list[str]  # the trainer's arguments (after `-m vigil_trainer`)
    env: dict[str, str]  # the rank's whole environment (the worker's `launch.rank_env`)
    cwd: str | None
    log: str  # the rank's log file
    token: str
    uid: int | None  # the job's user here (None: stay the worker's)
    gid: int | None
    cgroup: list[str]  # the job's cgroup.procs files


def parked_marker(exit_path: str | Path) -> Path:
    """Where a parked rank says why it parked: beside its exit file."""
    return Path(exit_path).with_suffix(".parked")


def write_parked_marker(exit_path: str | Path, reason: str) -> None:
    """Say why this rank parked (`parked_marker`), whole or not at all: the worker reads the marker while
    the rank lives, so it appears by an atomic rename (a plain write shows a reader an empty file first)."""
    marker = parked_marker(exit_path)
    tmp = marker.with_suffix(".parked-tmp")
    tmp.write_text(reason[-2000:] + "\n")
    os.replace(tmp, marker)


def next_socket(exit_path: str | Path) -> Path:
    """The Unix socket a parked rank takes its next attempt from (the launch, and its log's descriptor):
    beside its exit file."""
    return Path(exit_path).with_suffix(".next")


def cut_socket(exit_path: str | Path) -> Path:
    """The Unix socket on which a rank that parks takes its worker's word that its collectives' peer is
    gone for good (the attempt replaced): it then cuts their connections and parks. Beside its exit file."""
    return Path(exit_path).with_suffix(".cut")


def become(uid: int | None, gid: int | None, procs: Sequence[str | bytes], prctl: Any = None) -> None:
    """Join the job's cgroup (before the program can fork), drop to the job's user with no supplementary
    group, and forbid gaining privileges (setuid binaries, file capabilities) for good. Run by a rank's
    child before exec (the worker's `tenancy.enter`), or by a handed rank (`become_rank`)."""
    me = str(os.getpid()).encode()
    for path in procs:
        fd = os.open(path, os.O_WRONLY)
        try:
            os.write(fd, me)
        finally:
            os.close(fd)
    if uid is not None and gid is not None:
        os.setgroups([])
        os.setgid(gid)
        os.setuid(uid)
    prctl = prctl if prctl is not None else libc_prctl()
    if prctl is not None and prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_NO_NEW_PRIVS)")


def libc_prctl() -> Any:
    """Linux's prctl, typed; None elsewhere."""
    prctl = getattr(ctypes.CDLL(None, use_errno=True), "prctl", None)
    if prctl is not None:
        prctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong]
    return prctl


def become_rank(launch: Launch, log: int | None = None) -> None:
    """Take on the launched rank's output (`log`: its descriptor, already open), cgroup, user, environment,
    folder and token."""
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
    if launch["uid"] is not None and (prctl := libc_prctl()) is not None:  # a uid change made it
        prctl(PR_SET_DUMPABLE, 1, 0, 0, 0)  # undumpable: /proc/self is then root's
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
