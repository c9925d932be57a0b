"""The ranks a worker started: child processes from an argument list (never a shell), persisted so a
restarted worker finds them again.

Each rank runs in its own session (so a Ctrl-C meant for the worker does not kill training, and the
rank's whole process group can be signalled). Its record (pid, the kernel's start time of that pid,
log and exit-code file) lives in `<state_dir>/ranks.json`; a restarted worker checks each pid against
/proc (same pid *and* same start time, so a recycled pid is not mistaken for the rank) and reports the
truth: still running (adopted and watched), or exited with the code the rank wrote to its exit file,
or lost when it left none.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import subprocess
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

from vigil import protocol as proto
from vigil.exits import last_step_path

log = logging.getLogger("vigil.worker")


def start_ticks(pid: int) -> int | None:
    """The kernel's start time of `pid` (clock ticks since boot), or None if there is no such process."""
    try:
        with open(f"/proc/{pid}/stat") as fh:
            fields = fh.read().rsplit(")", 1)[1].split()
        return None if fields[0] == "Z" else int(fields[19])  # a zombie has exited
    except (FileNotFoundError, ProcessLookupError, IndexError, ValueError):
        return None


@dataclass(frozen=True)
class RankToStart:
    """One rank a launch starts on this node, as the agent and both rank runtimes (`RankTable`'s processes,
    `PodRankTable`'s pods) name it."""

    job_id: str
    attempt: int
    rank: int
    device: int
    log_path: Path
    exit_path: Path
    token: str = ""  # its link's credential (a pod's is minted by its relay on the first link: none here)
    uid: int | None = None  # the job's own user on this node (None: the worker's)
    world_size: int = 0
    builtin: bool = False  # the built-in trainer (a warm rank can take it), not the job's own program


@dataclass
class RankRecord:
    job_id: str
    attempt: int
    rank: int
    device: int
    pid: int
    ticks: int
    log_path: str
    exit_path: str
    started_at: float = field(default_factory=time.time)
    token: str = ""  # the rank's proof of identity to this agent's relay (ranks.json is 0600)
    uid: int | None = None  # the job's user it runs as; None: the worker's own
    builtin: bool = False  # the built-in trainer, whose exit code EXIT_SPEC says the spec cannot run
    world_size: int = 0  # the job's ranks (its reports may name no other); 0: not known
    killed: bool = False  # ended by this worker (cancel, newer attempt, a sibling's death)
    reported: bool = False  # RankExited published
    parked_at: float | None = None  # its collective failed: it waits for the job's next attempt (`park`)

    def alive(self) -> bool:
        return start_ticks(self.pid) == self.ticks


@dataclass
class Exit:
    code: int | None  # None when killed by a signal or unknown
    signal: int | None
    lost: bool = False  # no way to know how it ended (it left no exit file and was not our child)


class RankTable:
    def __init__(self, state_dir: Path) -> None:
        self.state_dir = state_dir
        self.path = state_dir / "ranks.json"
        self.records: list[RankRecord] = []
        self.attempts: dict[str, int] = {}  # job id -> highest attempt this worker has run
        self._children: dict[int, subprocess.Popen[bytes]] = {}

    # --- persistence --------------------------------------------------------------------------------------

    def load(self) -> None:
        if self.path.exists():
            raw = json.loads(self.path.read_text())
            self.records = [RankRecord(**r) for r in raw.get("ranks", [])]
            self.attempts = {k: int(v) for k, v in raw.get("attempts", {}).items()}

    def save(self) -> None:
        self.state_dir.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_suffix(".tmp")
        body = {"ranks": [asdict(r) for r in self.records if not r.reported], "attempts": self.attempts}
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)  # it holds the ranks' tokens
        with os.fdopen(fd, "w") as out:
            out.write(json.dumps(body, indent=1))
        os.replace(tmp, self.path)

    # --- queries --------------------------------------------------------------------------------------------

    def running(self, job_id: str | None = None) -> list[RankRecord]:
        return [r for r in self.records if not r.reported and (job_id is None or r.job_id == job_id)]

    def find(self, job_id: str, attempt: int, rank: int) -> RankRecord | None:
        """The running rank `rank` of `job_id`'s attempt `attempt`, if this worker started it."""
        return next(
            (
                r
                for r in self.running(job_id)
                if r.attempt == attempt and r.rank == rank and not r.killed and r.token
            ),
            None,
        )

    def on_device(self, index: int) -> RankRecord | None:
        return next((r for r in self.running() if r.device == index), None)

    # --- lifecycle ------------------------------------------------------------------------------------------

    def start(
        self,
        who: RankToStart,
        argv: list[str],
        env: dict[str, str],
        *,
        cwd: Path | None = None,
        enter: Callable[[], None] | None = None,
    ) -> RankRecord:
        """Start one rank. Its token reaches it on an inherited pipe (`protocol.RANK_TOKEN_FD_ENV` names the
        descriptor), never in its environment; `enter` runs in the child before exec (its cgroup, its
        user: `tenancy.enter`)."""
        self.clear(who.log_path, who.exit_path)
        read_end, write_end = os.pipe()
        try:
            os.write(write_end, who.token.encode())  # a few dozen bytes: far below a pipe's buffer
            os.close(write_end)
            with who.log_path.open("ab") as log:
                proc = subprocess.Popen(  # an argument list: no shell ever sees job input
                    argv,
                    env={**env, proto.RANK_TOKEN_FD_ENV: str(read_end)},
                    stdin=subprocess.DEVNULL,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                    close_fds=True,
                    pass_fds=(read_end,),
                    cwd=cwd,
                    preexec_fn=enter,
                )
        finally:
            os.close(read_end)
        return self.adopt(proc, who)

    @staticmethod
    def clear(log_path: Path, exit_path: Path) -> None:
        """Before a rank starts: its log's folder made, a previous attempt's exit files gone."""
        log_path.parent.mkdir(parents=True, exist_ok=True)
        exit_path.unlink(missing_ok=True)
        last_step_path(exit_path).unlink(missing_ok=True)

    def adopt(self, proc: subprocess.Popen[bytes], who: RankToStart) -> RankRecord:
        """Track a rank process: one `start` started, or a warm rank (`vigil_worker.warm`) just handed its
        launch (after `clear`)."""
        ticks = start_ticks(proc.pid)
        record = _record(who, proc.pid, ticks if ticks is not None else -1)
        self._children[proc.pid] = proc
        self.records.append(record)
        self.save()
        return record

    def hand_over(self, parked: RankRecord, who: RankToStart) -> RankRecord:
        """The parked process of `parked` goes on as `who` (its job's next attempt, same device): tracked
        under the new attempt, the old record done without a signal (its RankExited went out as it parked)."""
        record = _record(who, parked.pid, parked.ticks)
        parked.reported = True
        self.records = [r for r in self.records if not r.reported] + [record]
        self.save()
        return record

    def poll(self, record: RankRecord) -> Exit | None:
        """How the rank ended, or None while it runs."""
        child = self._children.get(record.pid)
        if child is not None:
            code = child.poll()
            if code is None:
                return None
            self._children.pop(record.pid, None)
            if code >= 0:
                return Exit(code=code, signal=None)
            if record.killed:  # the worker's own signal: its end, whatever the rank had declared
                return Exit(code=None, signal=-code)
            return self._declared(record, -code) or Exit(code=None, signal=-code)
        if record.alive():
            return None
        return self._exit_file(record)

    @staticmethod
    def _declared(record: RankRecord, sig: int) -> Exit | None:
        """The code a rank killed by `sig` had declared in its exit file before it died: a rank whose
        interpreter aborts in its teardown (a process group's C++ threads, pytorch#179291) after it
        finished, or wrote its emergency checkpoint, ended as it said. None: it declared nothing."""
        try:
            code = int(Path(record.exit_path).read_text().strip())
        except (FileNotFoundError, ValueError):
            return None
        log.warning(
            "rank %d of %s (pid %d) died of signal %d after it declared exit code %d: taking the code",
            record.rank,
            record.job_id,
            record.pid,
            sig,
            code,
        )
        return Exit(code=code, signal=None)

    @staticmethod
    def _exit_file(record: RankRecord) -> Exit:
        try:
            return Exit(code=int(Path(record.exit_path).read_text().strip()), signal=None)
        except (FileNotFoundError, ValueError):
            return Exit(code=None, signal=None, lost=True)

    def signal(self, record: RankRecord, sig: int) -> None:
        """Signal the rank's process group (the rank and anything it started)."""
        if record.pid in self._children or record.alive():
            with contextlib.suppress(ProcessLookupError):
                os.killpg(record.pid, sig)

    def notify(self, record: RankRecord, sig: int) -> None:
        """Signal the rank process alone: a notice it handles (its helpers would die of it)."""
        if record.pid in self._children or record.alive():
            with contextlib.suppress(ProcessLookupError):
                os.kill(record.pid, sig)

    def terminate(self, record: RankRecord) -> None:
        record.killed = True
        self.signal(record, signal.SIGTERM)
        self.save()

    def mark_reported(self, record: RankRecord) -> None:
        record.reported = True
        self.records = [r for r in self.records if not r.reported]
        self.save()


def _record(who: RankToStart, pid: int, ticks: int) -> RankRecord:
    return RankRecord(
        job_id=who.job_id,
        attempt=who.attempt,
        rank=who.rank,
        device=who.device,
        pid=pid,
        ticks=ticks,
        log_path=str(who.log_path),
        exit_path=str(who.exit_path),
        token=who.token,
        uid=who.uid,
        builtin=who.builtin,
        world_size=who.world_size,
    )
