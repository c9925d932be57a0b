"""The two pieces a job's boundary on a node is made of, each on its own: the per-job cgroup (limits
written, a kill that leaves nothing, a double-forked child included) on this machine's real cgroups, and
the uid pool (one uid per job, never another job's, shared by one job's workers on one host)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from tests.helpers import eventually
from vigil_worker import cgroups
from vigil_worker.procs import start_ticks
from vigil_worker.tenancy import JobUser, enter
from vigil_worker.uids import UidPool, processes_of

pytestmark = [
    pytest.mark.integration,
    pytest.mark.security,
    pytest.mark.skipif(os.geteuid() != 0, reason="cgroups and uids are switched by root only"),
]

# a program that double-forks a child out of its session and process group, prints its pid, and waits
ESCAPER = """
import os, sys, time
if os.fork() == 0:
    os.setsid()
    if os.fork() == 0:
        print(os.getpid(), flush=True)
        time.sleep(3600)
    os._exit(0)
time.sleep(3600)
"""


def escaper(user: JobUser, group: cgroups.JobCgroup | None) -> tuple[subprocess.Popen[bytes], int]:
    """ESCAPER started as a rank is (`tenancy.enter`), and the pid of its double-forked child."""
    proc = subprocess.Popen(
        [sys.executable, "-c", ESCAPER],
        stdout=subprocess.PIPE,
        start_new_session=True,
        preexec_fn=enter(user, group),
    )
    assert proc.stdout is not None
    return proc, int(proc.stdout.readline())


def read(path: str) -> str:
    return Path(path).read_text()


@pytest.fixture
def layout() -> cgroups.Layout:
    found = cgroups.detect(f"test-{uuid.uuid4().hex[:6]}")
    if found is None:
        pytest.skip("no usable cgroups here")
    yield found
    for folder in (found.unified, *found.v1.values()):
        folder.rmdir()


async def test_a_jobs_cgroup_gets_its_limits_and_its_kill_leaves_no_process(layout: cgroups.Layout):
    group = layout.job("j-test", 1)
    group.create(cgroups.Limits(max_processes=64, memory_bytes=256 * 1024 * 1024, cpus=0.5))
    if layout.version == "v2":
        here = layout.unified / group.name
        assert (here / "pids.max").read_text().strip() == "64"
        assert (here / "memory.max").read_text().strip() == str(256 * 1024 * 1024)
        assert (here / "cpu.max").read_text().split()[0] == "50000"
    else:
        assert (layout.v1["pids"] / group.name / "pids.max").read_text().strip() == "64"
        assert int((layout.v1["memory"] / group.name / "memory.limit_in_bytes").read_text()) == 256 * 1024**2
        if "cpu" in layout.v1:
            assert (layout.v1["cpu"] / group.name / "cpu.cfs_quota_us").read_text().strip() == "50000"
    user = JobUser(60990)
    proc, escapee = escaper(user, group)
    try:
        assert {proc.pid, escapee} <= group.pids()  # joined before exec: its children are in it too
        assert os.stat(f"/proc/{escapee}").st_uid == user.uid
        status = dict(line.split(":", 1) for line in read(f"/proc/{proc.pid}/status").splitlines())
        assert status["NoNewPrivs"].strip() == "1" and status["Groups"].strip() == ""
        assert await group.remove(timeout_s=10)
        assert start_ticks(escapee) is None and proc.wait(10) == -signal.SIGKILL  # gone (or a zombie)
        assert not any(folder.exists() for folder in group.folders)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)


def test_a_pool_gives_each_job_its_own_uid_and_one_job_the_same_on_two_workers(tmp_path: Path):
    uids = range(61000, 61004)
    a, b = UidPool(uids, "node-a", tmp_path), UidPool(uids, "node-b", tmp_path)
    first = a.acquire("job-1")
    assert first in uids and first != os.getuid()
    assert b.acquire("job-1") == first  # both workers of one host run job-1 as one uid
    others = {a.acquire(f"job-{k}") for k in range(2, 5)}
    assert first not in others and len(others) == 3  # never another job's
    with pytest.raises(RuntimeError, match="VIGIL_JOB_UIDS"):
        a.acquire("job-5")
    assert a.release("job-1", first) is False  # node-b still holds it
    assert b.release("job-1", first) is True
    assert a.acquire("job-5") == first  # free again


async def test_releasing_a_jobs_uid_ends_every_process_left_of_it(tmp_path: Path):
    pool = UidPool(range(61010, 61011), "node-a", tmp_path)
    uid = pool.acquire("job-1")
    proc, escapee = escaper(JobUser(uid), None)
    assert set(processes_of(uid)) >= {proc.pid, escapee}
    assert pool.release("job-1", uid)
    await eventually(lambda: _none_of(uid), timeout=10, what=f"every process of uid {uid} to end")
    proc.wait(10)


async def _none_of(uid: int) -> bool:
    return not processes_of(uid)


def test_a_pool_never_holds_the_workers_uid():
    with pytest.raises(ValueError, match="worker's own uid"):
        UidPool(range(os.getuid(), os.getuid() + 2), "n")
