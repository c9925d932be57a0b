"""A job's cgroup on this node: its ranks' limits (processes, memory, CPU) and one way to end them all.

Job cgroups go under the worker's own cgroup, in a folder of its node (`vigil-<node>`), one per attempt
(`job-<job id>-a<attempt>`): an attempt's cgroup is killed and removed once its ranks are reported, while
the next attempt may already run in its own. Two layouts, told apart by `detect`:

- cgroup v2 (`/sys/fs/cgroup` is cgroup2 with the pids and memory controllers): one folder holds the
  members and the limits (`pids.max`, `memory.max`, `cpu.max`) and ends them with `cgroup.kill`. Limits
  need the controllers enabled in the parents' `cgroup.subtree_control`, which the kernel refuses while
  a parent holds processes: the worker's own cgroup's processes are moved into a leaf
  (`vigil-supervisor`) first, as systemd asks of a service with `Delegate=yes`.
- hybrid (cgroup v1 controllers, and a cgroup2 without controllers, e.g. at `/sys/fs/cgroup/unified`):
  membership and the kill are the cgroup2 folder's (`cgroup.kill`); the limits are the v1 `pids`,
  `memory` and `cpu` controllers' (`pids.max`, `memory.limit_in_bytes`, `cpu.cfs_quota_us`).

A rank joins its cgroup before it runs a line of the job's program: the child writes itself into each
folder's `cgroup.procs` between fork and exec (`vigil_worker.tenancy`). Written from the parent after the
fork, the program could fork first and its child would be outside the cgroup.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

log = logging.getLogger("vigil.worker")

MOUNTINFO = Path("/proc/self/mountinfo")
OWN_CGROUP = Path("/proc/self/cgroup")
LIMITED = ("pids", "memory", "cpu")  # the controllers whose limits a spec sets
CPU_PERIOD_US = 100_000
SUPERVISOR = "vigil-supervisor"  # v2: the leaf the worker's own cgroup's processes move into


@dataclass(frozen=True)
class Limits:
    """What one job's ranks on one node may use together (the spec's `resources`)."""

    max_processes: int
    memory_bytes: int | None = None
    cpus: float | None = None


@dataclass(frozen=True)
class Layout:
    """Where this node's job cgroups go. `unified`: the cgroup2 folder that holds them (membership and
    kill; in v2 also the limits); `v1`: for a hybrid layout, each limit controller's folder."""

    version: Literal["v2", "hybrid"]
    unified: Path
    v1: dict[str, Path]

    def job(self, job_id: str, attempt: int) -> JobCgroup:
        return JobCgroup(self, f"job-{job_id}-a{attempt}")

    def remove(self) -> None:
        """This node's folders, where they hold no job cgroup any more."""
        for folder in (self.unified, *self.v1.values()):
            with contextlib.suppress(OSError):
                folder.rmdir()

    def jobs(self) -> list[JobCgroup]:
        """Every job cgroup this node's folder holds (a restarted worker cleans up after its ranks)."""
        if not self.unified.is_dir():
            return []
        found = [p.name for p in self.unified.iterdir() if p.is_dir() and p.name.startswith("job-")]
        return [JobCgroup(self, name) for name in found]


def _mounts(mountinfo: Path) -> tuple[Path | None, dict[str, Path]]:
    """The cgroup2 mount point, and each v1 controller's."""
    unified: Path | None = None
    v1: dict[str, Path] = {}
    for line in mountinfo.read_text().splitlines():
        left, _, right = line.partition(" - ")
        fields, tail = left.split(), right.split()
        if len(fields) < 5 or len(tail) < 3:
            continue
        point, fstype, options = Path(fields[4]), tail[0], tail[2].split(",")
        if fstype == "cgroup2" and unified is None:
            unified = point
        elif fstype == "cgroup":
            for controller in LIMITED:
                if controller in options:
                    v1.setdefault(controller, point)
    return unified, v1


def _own_paths(own: Path) -> tuple[str, dict[str, str]]:
    """This process's cgroup2 path, and its path in each v1 hierarchy (by controller)."""
    v2, v1 = "/", {}
    for line in own.read_text().splitlines():
        _, controllers, path = line.split(":", 2)
        if controllers == "":
            v2 = path
        for controller in controllers.split(","):
            v1[controller] = path
    return v2, v1


def detect(node: str, *, mountinfo: Path = MOUNTINFO, own: Path = OWN_CGROUP) -> Layout | None:
    """This node's layout for job cgroups, the node's folders made; None where cgroups cannot be used
    (not Linux, not root, no cgroup2 mounted, the limit controllers missing)."""
    try:
        unified_mount, v1_mounts = _mounts(mountinfo)
        v2_path, v1_paths = _own_paths(own)
    except OSError:
        return None
    if unified_mount is None or os.geteuid() != 0:
        return None
    folder = f"vigil-{node}"
    unified_own = unified_mount / v2_path.lstrip("/")
    controllers = _read(unified_mount / "cgroup.controllers").split()
    try:
        if {"pids", "memory"} <= set(controllers):
            enable = " ".join(f"+{c}" for c in LIMITED if c in controllers)
            _delegate(unified_own, enable)
            base = unified_own / folder
            base.mkdir(exist_ok=True)
            (base / "cgroup.subtree_control").write_text(enable)
            return Layout("v2", base, {})
        if not {"pids", "memory"} <= set(v1_mounts):
            return None
        base = unified_own / folder
        base.mkdir(exist_ok=True)
        v1 = {c: v1_mounts[c] / v1_paths.get(c, "/").lstrip("/") / folder for c in v1_mounts}
        for path in v1.values():
            path.mkdir(exist_ok=True)
        return Layout("hybrid", base, v1)
    except OSError as exc:
        log.warning("cgroups: cannot make this node's folders (%s); jobs run without cgroups", exc)
        return None


def _delegate(own: Path, enable: str) -> None:
    """Enable the limit controllers below the worker's own v2 cgroup. A cgroup other than the root that
    holds processes cannot enable controllers for its children: its processes move into a leaf first."""
    try:
        (own / "cgroup.subtree_control").write_text(enable)
    except OSError:
        leaf = own / SUPERVISOR
        leaf.mkdir(exist_ok=True)
        for pid in _read(own / "cgroup.procs").split():
            with contextlib.suppress(OSError):  # one that exited meanwhile
                (leaf / "cgroup.procs").write_text(pid)
        (own / "cgroup.subtree_control").write_text(enable)


@dataclass(frozen=True)
class JobCgroup:
    """One attempt's cgroup on this node (a folder per hierarchy of its layout)."""

    layout: Layout
    name: str

    @property
    def folders(self) -> list[Path]:
        return [self.layout.unified / self.name, *(base / self.name for base in self.layout.v1.values())]

    def create(self, limits: Limits) -> None:
        """Make the folders and write `limits`."""
        for folder in self.folders:
            folder.mkdir(exist_ok=True)
        if self.layout.version == "v2":
            here = self.layout.unified / self.name
            _write(here / "pids.max", str(limits.max_processes))
            _write(here / "memory.max", "max" if limits.memory_bytes is None else str(limits.memory_bytes))
            if (here / "memory.swap.max").exists() and limits.memory_bytes is not None:
                _write(here / "memory.swap.max", "0")  # the limit is the memory's, not swap's
            if (here / "cpu.max").exists():
                quota = "max" if limits.cpus is None else str(max(1000, int(limits.cpus * CPU_PERIOD_US)))
                _write(here / "cpu.max", f"{quota} {CPU_PERIOD_US}")
            return
        v1 = {c: base / self.name for c, base in self.layout.v1.items()}
        _write(v1["pids"] / "pids.max", str(limits.max_processes))
        _write(v1["memory"] / "memory.limit_in_bytes", str(limits.memory_bytes or -1))
        if "cpu" in v1:
            _write(v1["cpu"] / "cpu.cfs_period_us", str(CPU_PERIOD_US))
            quota = -1 if limits.cpus is None else max(1000, int(limits.cpus * CPU_PERIOD_US))
            _write(v1["cpu"] / "cpu.cfs_quota_us", str(quota))
        elif limits.cpus is not None:
            log.warning("cgroups: no v1 cpu controller here; resources.cpus of %s is not enforced", self.name)

    def procs_files(self) -> list[bytes]:
        """Each folder's `cgroup.procs`, as the child writes itself into them (bytes: no encoding after
        fork)."""
        return [os.fsencode(folder / "cgroup.procs") for folder in self.folders]

    def pids(self) -> set[int]:
        """Every process in the cgroup (any of its folders)."""
        found: set[int] = set()
        for folder in self.folders:
            found |= {int(p) for p in _read(folder / "cgroup.procs").split()}
        return found

    def kill(self) -> None:
        """SIGKILL every process in the cgroup, a forked child's forked child among them."""
        kill_file = self.layout.unified / self.name / "cgroup.kill"
        if kill_file.exists():
            _write(kill_file, "1")  # the kernel's: no fork escapes it
            return
        for pid in self.pids():  # older kernels: again until empty (`remove` waits)
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)

    async def remove(self, timeout_s: float = 10.0) -> bool:
        """Kill what is left, wait until the cgroup is empty, remove its folders; False if a process
        outlived `timeout_s` (the folders are then left, and `Layout.jobs` finds them again)."""
        deadline = time.monotonic() + timeout_s
        while self.pids():
            if time.monotonic() > deadline:
                log.error("cgroups: %s still holds %s after its kill", self.name, sorted(self.pids()))
                return False
            self.kill()
            await asyncio.sleep(0.05)  # the kernel reaps the killed processes
        for folder in self.folders:
            with contextlib.suppress(FileNotFoundError):
                folder.rmdir()
        return True


def _read(path: Path) -> str:
    try:
        return path.read_text()
    except FileNotFoundError:
        return ""


def _write(path: Path, value: str) -> None:
    with path.open("w") as out:
        out.write(value)
