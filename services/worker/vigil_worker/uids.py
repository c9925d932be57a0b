"""The uids jobs run as on this host: a pool (VIGIL_JOB_UIDS), one uid per job, never two jobs' at once.

A uid needs no /etc/passwd entry: the worker starts a rank with that numeric uid as user and group and no
supplementary group. Leases are host-wide (in `/run`, cleared at boot like the processes they cover), so
two workers on one host never give one uid to two jobs; both ranks of one job that two workers on one
host run (tests, shared storage) get the same uid, and so own the same checkpoint folder. A job's
preferred uid is a hash of its id (the same on every host whose pool is the same), the next free one
where that is taken.

`<leases>/<uid>/job` names the job; `<leases>/<uid>/<node>` holds the pid of each worker that holds it.
A lease whose workers are all gone and whose uid runs no process is stale, and given out again.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
import shutil
import signal
from collections.abc import Iterator
from pathlib import Path

LEASES = Path("/run/vigil/job-uids")
NOBODY = 65534


class PoolExhausted(RuntimeError):
    """Every uid of the pool runs a job."""


def processes_of(uid: int) -> list[int]:
    """The pids of the processes running as `uid` (their /proc folder's owner: the effective uid); a
    zombie, which runs nothing any more and waits for its parent, is not one."""
    found = []
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            with contextlib.suppress(OSError, IndexError):
                if entry.stat().st_uid == uid and _state(entry.path) != "Z":
                    found.append(int(entry.name))
    return found


def _state(proc: str) -> str:
    with open(f"{proc}/stat") as fh:
        return fh.read().rsplit(")", 1)[1].split()[0]


def kill_uid(uid: int) -> None:
    """SIGKILL every process running as `uid`, from a child that becomes `uid` and sends kill(-1): the
    kernel signals them all at once, so no fork in the meantime escapes."""
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        try:
            os.setgroups([])
            os.setgid(uid)
            os.setuid(uid)
            with contextlib.suppress(ProcessLookupError):
                os.kill(-1, signal.SIGKILL)
        finally:
            os._exit(0)
    os.waitpid(pid, 0)


class UidPool:
    def __init__(self, uids: range, node: str, leases: Path = LEASES) -> None:
        if not uids:
            raise ValueError("an empty uid pool")
        if os.getuid() in uids:
            raise ValueError(f"the uid pool {uids.start}-{uids.stop - 1} holds the worker's own uid")
        self.uids, self.node, self.leases = uids, node, leases

    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        self.leases.mkdir(parents=True, exist_ok=True, mode=0o700)
        with open(self.leases / ".lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            yield

    def _order(self, job_id: str) -> Iterator[int]:
        start = int(hashlib.sha256(job_id.encode()).hexdigest(), 16) % len(self.uids)
        for k in range(len(self.uids)):
            uid = self.uids[(start + k) % len(self.uids)]
            if uid != NOBODY:
                yield uid

    def acquire(self, job_id: str) -> int:
        """The uid `job_id` runs as on this host (the one it holds already, or a free one)."""
        with self._locked():
            for uid in self._order(job_id):
                lease = self.leases / str(uid)
                if lease.is_dir() and _read(lease / "job") != job_id and self._stale(lease, uid):
                    shutil.rmtree(lease)
                if not lease.is_dir():
                    if processes_of(uid):
                        continue  # someone else's uid, or a job's left over outside the pool's leases
                    lease.mkdir(mode=0o700)
                    (lease / "job").write_text(job_id)
                elif _read(lease / "job") != job_id:
                    continue
                (lease / self.node).write_text(str(os.getpid()))
                return uid
        span = f"{self.uids.start}-{self.uids.stop - 1}"
        raise PoolExhausted(f"every uid of VIGIL_JOB_UIDS ({span}) runs a job")

    def release(self, job_id: str, uid: int) -> bool:
        """This node holds `uid` for `job_id` no more. With the last holder (another worker on this host
        may run ranks of the same job as the same uid) every process left of `uid` is killed, a child
        that a rank double-forked out of its cgroup among them, and the lease goes; True then."""
        with self._locked():
            lease = self.leases / str(uid)
            if _read(lease / "job") != job_id:
                return False
            (lease / self.node).unlink(missing_ok=True)
            if [p for p in lease.iterdir() if p.name != "job"]:
                return False
            kill_uid(uid)
            shutil.rmtree(lease, ignore_errors=True)
            return True

    @staticmethod
    def _stale(lease: Path, uid: int) -> bool:
        holders = [p for p in lease.iterdir() if p.name != "job"]
        return not any(_pid_alive(_read(h)) for h in holders) and not processes_of(uid)


def _read(path: Path) -> str:
    try:
        return path.read_text().strip()
    except OSError:
        return ""


def _pid_alive(text: str) -> bool:
    return text.isdigit() and Path(f"/proc/{text}").exists()
