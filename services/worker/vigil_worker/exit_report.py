"""How a rank's end is told: the `RankExited` a worker publishes for a rank that ended (its failure
classified from how it ended) or that parked (`vigil_worker.parked`: exit code 6, a failure; the process
waits for its job's next attempt)."""

from __future__ import annotations

import signal
from pathlib import Path

from vigil.events import FailureType, RankExited
from vigil.exits import EXIT_PARKED, EXIT_PREEMPTED, EXIT_SPEC, read_last_step
from vigil_worker.procs import Exit, RankRecord

LOG_TAIL_BYTES = 4000


def failure_of(r: RankRecord, ended: Exit) -> FailureType:
    if r.killed:
        return "killed_by_vigil"
    if ended.lost:
        return "lost"
    if ended.signal is not None:
        return "oom" if ended.signal == signal.SIGKILL and _oom_killed() else "signal"
    if ended.code == EXIT_PREEMPTED:
        return "preempted"
    if ended.code == EXIT_SPEC and r.builtin:  # a user's program may exit 2 for its own reasons
        return "spec"
    return "ok" if ended.code == 0 else "error"


def rank_exited(r: RankRecord, node: str, ended: Exit, failure: FailureType) -> RankExited:
    return RankExited(
        job_id=r.job_id,
        attempt=r.attempt,
        rank=r.rank,
        node=node,
        exit_code=ended.code,
        signal=ended.signal,
        failure=failure,
        last_step=read_last_step(r.exit_path),
        log_tail=log_tail(Path(r.log_path)),
    )


def rank_parked(r: RankRecord, node: str) -> RankExited:
    """To the control plane a parked rank exited with a failure: its fault is judged as any other."""
    return rank_exited(r, node, Exit(code=EXIT_PARKED, signal=None), "error")


def log_tail(path: Path) -> str:
    try:
        with path.open("rb") as fh:
            fh.seek(max(0, path.stat().st_size - LOG_TAIL_BYTES))
            return fh.read().decode("utf-8", errors="replace")
    except OSError:
        return ""


def _oom_killed() -> bool:
    """Best effort: did the kernel's OOM killer act recently (cgroup v2 counter)?"""
    try:
        events = Path("/sys/fs/cgroup/memory.events").read_text()
        return any(line.startswith("oom_kill ") and int(line.split()[1]) > 0 for line in events.splitlines())
    except (OSError, ValueError):
        return False
