"""A job's ranks are a tenant: the user they run as, their cgroup, and what they reach on disk.

On a root worker with a uid pool (VIGIL_JOB_UIDS, by default 60000-60999 when root) each job runs as a
uid of its own (`uids`): no supplementary group, PR_SET_NO_NEW_PRIVS, its own session, in its attempt's
cgroup (`cgroups`). The worker's files are laid out so that such a user reaches only its own:

| path | owner, mode | a job's user |
| --- | --- | --- |
| data dir | worker, 0711 | passes; lists nothing (credentials.json, nats.conf, endpoints.json: 0600) |
| `worker/` (ranks.json: every rank's token) | worker, 0700 | cannot enter |
| `logs/`, `cache/` | worker, 0700 | cannot enter (the worker opens a rank's log for it) |
| `runs/`, `checkpoints/` | worker, 0711 | passes through; lists nothing |
| `runs/<job>/` (launch.json, exit files, home, cache) | the job's uid, 0700 | its own job's only |
| `checkpoints/<job>/` | the job's uid, 0700 | its own job's only |
| `sockets/<node>.sock` (the relay) | worker, 0666 in 0711 | connects; proves its rank by token and uid |

Where the worker cannot switch users (not root, or VIGIL_JOB_UIDS=off) every rank runs as the worker, and
a job's own program (`entrypoint`) is refused unless VIGIL_SHARED_TRUST=true accepts that every job and
the worker are one trust domain.

All of this is the process runtime's. With VIGIL_RANK_RUNTIME=kubernetes the worker starts no process: a
job's pod is its tenant (its own uid, ServiceAccount and NetworkPolicy, `rank_pod`), so no uid is drawn
here and no cgroup made.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import stat
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from vigil.errors import RetryableError
from vigil.events import LaunchJob
from vigil.handover import become, libc_prctl
from vigil_common.confine import let_traverse
from vigil_common.settings import Settings
from vigil_worker import cgroups
from vigil_worker.uids import PoolExhausted, UidPool

log = logging.getLogger("vigil.worker")

MIB = 1024 * 1024


@dataclass(frozen=True)
class JobUser:
    """The numeric user (and group: the same number) a job's ranks run as on this node."""

    uid: int

    @property
    def gid(self) -> int:
        return self.uid

    @property
    def name(self) -> str:  # USER and LOGNAME: no /etc/passwd entry is needed
        return f"vigil-job-{self.uid}"


def job_dir(settings: Settings, job_id: str) -> Path:
    """A job's own folder on this node: its attempts' run folders, its home and its data cache."""
    return settings.data_dir.resolve() / "runs" / job_id


SHM = Path("/dev/shm")


def snapshot_dir(settings: Settings, job_id: str) -> Path | None:
    """A job's in-memory snapshots on this node (`vigil.snapshot`): on /dev/shm, so that they outlive a
    rank's process (not the node); None where the node has no /dev/shm."""
    return SHM / f"vigil-{settings.node_name}" / job_id if SHM.is_dir() else None


def limits(launch: LaunchJob) -> cgroups.Limits:
    r = launch.spec.resources
    return cgroups.Limits(
        max_processes=r.max_processes,
        memory_bytes=None if r.memory_mb is None else r.memory_mb * MIB,
        cpus=r.cpus,
    )


class Tenancy:
    """This node's users and cgroups for jobs, and the modes of the worker's folders."""

    def __init__(self, settings: Settings, *, leases: Path | None = None) -> None:
        self.settings = settings
        root = os.geteuid() == 0 and settings.rank_runtime == "process"  # a rank pod is its own tenant
        uids = settings.job_uid_range(root)
        self.pool = None if uids is None else UidPool(uids, settings.node_name, *(leases,) if leases else ())
        self.layout = cgroups.detect(settings.node_name) if root else None
        self.users: dict[str, JobUser] = {}  # job id -> its user here, while it has ranks here

    @property
    def isolated(self) -> bool:
        """Each job runs as its own user here."""
        return self.pool is not None

    # --- the node ----------------------------------------------------------------------------------------

    def prepare_node(self) -> None:
        """The worker's folders made with the modes in the module's table; the interpreter, the data dir
        and the code and data roots reachable by a job's user (search permission on the folders above)."""
        if not self.isolated:
            return
        data = self.settings.data_dir.resolve()
        modes = {data: 0o711, data / "worker": 0o700, data / "logs": 0o700, data / "cache": 0o700,
                 data / "runs": 0o711, data / "checkpoints": 0o711}  # fmt: skip
        for path, mode in modes.items():
            path.mkdir(parents=True, exist_ok=True)
            os.chmod(path, mode)
        reach = [Path(sys.executable).resolve(), Path(sys.prefix), Path(sys.base_prefix), data]
        roots = [*self.settings.allowed_code_roots, *self.settings.allowed_data_roots]
        for path in [*reach, *roots]:
            for folder in let_traverse(path):
                log.warning("made %s searchable by others (o+x) so that jobs' users reach %s", folder, path)
        for root in roots:  # jobs read their code and data here
            if root.is_dir() and stat.S_IMODE(root.stat().st_mode) & 0o005 != 0o005:
                os.chmod(root, stat.S_IMODE(root.stat().st_mode) | 0o005)

    # --- a job's user --------------------------------------------------------------------------------------

    def user_for(self, job_id: str) -> JobUser | None:
        """The user `job_id` runs as here (None: the worker's own); RetryableError when the pool is spent."""
        if self.pool is None:
            return None
        try:
            user = JobUser(self.pool.acquire(job_id))
        except PoolExhausted as exc:
            raise RetryableError(str(exc)) from exc
        self.users[job_id] = user
        return user

    def adopt(self, job_id: str, uid: int | None) -> None:
        """A restarted worker holds again the uid of a job whose ranks still run."""
        if self.pool is not None and uid is not None:
            self.users[job_id] = JobUser(self.pool.acquire(job_id))

    def give_to(self, user: JobUser, settings: Settings, job_id: str, attempt: int) -> None:
        """The job's folders made and owned by its user: its run folder (attempt, home, cache, tmp) and its
        checkpoint folder, with everything in them (a relaunch may run as another uid)."""
        mine = job_dir(settings, job_id)
        for name in ("home", "cache", "tmp", f"attempt-{attempt}"):
            (mine / name).mkdir(parents=True, exist_ok=True)
        checkpoints = settings.checkpoint_root / job_id
        checkpoints.mkdir(parents=True, exist_ok=True)
        owned = [mine, checkpoints]
        if (snapshots := snapshot_dir(settings, job_id)) is not None and _node_shm(snapshots.parent):
            snapshots.mkdir(exist_ok=True)
            owned.append(snapshots)
        for path in owned:
            _own_tree(path, user)

    def own_snapshots(self, job_id: str) -> None:
        """The in-memory snapshot folder of a job that runs as the worker's own user (no uid pool: the
        worker is not root, as in its image, or VIGIL_JOB_UIDS=off), the worker's; `give_to` makes it for a
        job's user. Without it the ranks, handed its path, failed at their first snapshot."""
        if (snapshots := snapshot_dir(self.settings, job_id)) is not None and _node_shm(snapshots.parent):
            snapshots.mkdir(mode=0o700, exist_ok=True)

    def forget_snapshots(self, job_id: str) -> None:
        """The job's in-memory snapshots here removed (a job that succeeds removes its own)."""
        if (snapshots := snapshot_dir(self.settings, job_id)) is not None:
            shutil.rmtree(snapshots, ignore_errors=True)

    def sweep_snapshots(self, running: set[str]) -> list[str]:
        """At the worker's start: the in-memory snapshots of every job with no rank here removed (a job
        that failed for good, or whose relaunch went elsewhere, would hold this node's memory forever);
        the jobs whose snapshots went."""
        node = snapshot_dir(self.settings, "-")
        if node is None or not node.parent.is_dir() or node.parent.is_symlink():
            return []
        gone = sorted(p.name for p in node.parent.iterdir() if p.name not in running)
        for job_id in gone:
            self.forget_snapshots(job_id)
        return gone

    def release(self, job_id: str) -> None:
        """The job has no rank here any more: end every process left of its user, give the uid back, and
        remove its temporary files (`TMPDIR`: inductor's precompiled headers alone are 147 MB a job)."""
        user = self.users.pop(job_id, None)
        if user is None or self.pool is None:
            return
        self.pool.release(job_id, user.uid)  # with the host's last holder, its user's every process
        shutil.rmtree(job_dir(self.settings, job_id) / "tmp", ignore_errors=True)

    # --- a job's cgroup ------------------------------------------------------------------------------------

    def cgroup(self, launch: LaunchJob) -> cgroups.JobCgroup | None:
        """The attempt's cgroup here, made with the spec's limits; None where cgroups are not used."""
        if self.layout is None:
            return None
        group = self.layout.job(str(launch.job_id), launch.attempt)
        group.create(limits(launch))
        return group

    async def end_cgroup(self, job_id: str, attempt: int) -> None:
        if self.layout is not None:
            await self.layout.job(job_id, attempt).remove()

    def close(self) -> None:
        """The worker stops with no rank left: its node's cgroup folders go (any left non-empty stay), and
        its node's snapshot folder with every job's snapshots in it (the next start would sweep them: no
        rank of theirs runs here)."""
        if self.layout is not None:
            self.layout.remove()
        self.sweep_snapshots(set())
        if (node := snapshot_dir(self.settings, "-")) is not None and not node.parent.is_symlink():
            with contextlib.suppress(OSError):
                node.parent.rmdir()


def _node_shm(folder: Path) -> bool:
    """This node's folder of snapshots on /dev/shm, the worker's (0711): made here, or refused (logged)
    when someone else made it first (a job's user could otherwise own every job's snapshots)."""
    with contextlib.suppress(FileExistsError):
        folder.mkdir(mode=0o711)
    found = os.lstat(folder)
    if not stat.S_ISDIR(found.st_mode) or found.st_uid != os.geteuid():
        log.error("%s is not a folder of the worker's user: in-memory snapshots stay in the ranks", folder)
        return False
    os.chmod(folder, 0o711)
    return True


def _own_tree(path: Path, user: JobUser) -> None:
    """`path` (0700) and everything below it owned by `user`. Walked by folder descriptors, never through
    a symlink (a job may have swapped a folder for one meanwhile), nor into another file system (a mount);
    a file with another hard link is left as it is (it may be someone else's file, linked into the job's
    folder)."""
    os.chown(path, user.uid, user.gid, follow_symlinks=False)
    os.chmod(path, 0o700)
    device = os.stat(path, follow_symlinks=False).st_dev
    for _, dirs, files, top in os.fwalk(path, follow_symlinks=False):
        for name in (*dirs, *files):
            with contextlib.suppress(FileNotFoundError):
                found = os.stat(name, dir_fd=top, follow_symlinks=False)
                if stat.S_ISREG(found.st_mode) and found.st_nlink > 1:
                    continue
                os.chown(name, user.uid, user.gid, dir_fd=top, follow_symlinks=False)
        # a mount in it (an attempt's overlay, `workdirs`) is not walked: its root is given, not its files
        dirs[:] = [d for d in dirs if _same_device(d, top, device)]


def _same_device(name: str, top: int, device: int) -> bool:
    try:
        return os.stat(name, dir_fd=top, follow_symlinks=False).st_dev == device
    except FileNotFoundError:
        return False


def enter(user: JobUser | None, group: cgroups.JobCgroup | None) -> Callable[[], None]:
    """What the child runs between fork and exec (`become`). Everything is resolved before the fork and
    the child makes system calls only: a `preexec_fn` in a process with threads must not take a lock
    another thread may hold."""
    procs = group.procs_files() if group is not None else []
    uid, gid = (user.uid, user.gid) if user is not None else (None, None)
    prctl = libc_prctl()

    def child() -> None:
        become(uid, gid, procs, prctl)

    return child
