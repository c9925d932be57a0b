"""Slurm over two hosts: a slurmd in each (network namespaces hosta and hostb, each under its own host name),
one slurmctld and munged on the first. The example `deploy/slurm/vigil-job.sbatch` runs a 2-node
job: `vigil slurm run` (the batch step, on hosta) starts a worker on each host, which advertises the
address its Slurm node name resolves to, and the job's two ranks rendezvous across the hosts; Slurm reports
COMPLETED. A worker that dies while the job runs ends the workers' step: `vigil slurm run` sees it, cancels
the Vigil job, fails saying why, and Slurm reports the allocation FAILED."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import tempfile
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.integration.scheduler.conftest import launched, next_event, wait_state
from tests.integration.slurm.conftest import BINARIES, COMMON_CONF, SlurmCluster, start_munged, stop_daemon
from vigil.events import RankStarted, StepCompleted
from vigil_bench.netns import Host, Network
from vigil_cli.slurm import worker_name
from vigil_common import subjects

from .conftest import TOKEN, Plane

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.slurm, pytest.mark.multihost]

TINY = {"preset": "tiny", "n_layer": 2, "seq_len": 32}
TRAIN = {"micro_batch": 4, "lr": 3e-3, "warmup_steps": 1, "zero_stage": 1}


def slurm_conf(root: Path, network: Network) -> str:
    """The controller on the first host; one CPU per node: a 2-rank job needs both nodes (and `vigil slurm
    worker` gives each one slot). A host is a machine of its own: Slurm's default ports."""
    head = network.hosts[0]
    nodes = "\n".join(
        f"NodeName={h.hostname} NodeAddr={h.address} CPUs=1 State=UNKNOWN" for h in network.hosts
    )
    return f"""\
ClusterName=vigilmh
SlurmctldHost={head.hostname}({head.address})
SlurmctldPort=6817
SlurmdPort=6818
AuthInfo=socket={root}/munge/munge.socket
StateSaveLocation={root}/state
SlurmdSpoolDir={root}/spool/%n
SlurmctldPidFile={root}/slurmctld.pid
SlurmdPidFile={root}/slurmd-%n.pid
SlurmctldLogFile={root}/log/slurmctld.log
SlurmdLogFile={root}/log/slurmd-%n.log
{COMMON_CONF}KillWait=5
{nodes}
PartitionName=vigil Nodes=ALL Default=YES MaxTime=INFINITE State=UP
"""


@pytest.fixture(scope="module")
def slurm_hosts(network: Network) -> Iterator[SlurmCluster]:
    """munged and slurmctld on the first host, a slurmd on each; the Slurm commands run here (the test's
    namespace) reach the controller over the bridge. `node` is the first host's. Every daemon runs in a
    host, so whatever ends the hosts (`Network.destroy`) ends them too."""
    missing = [b for b in BINARIES if not shutil.which(b)]
    if missing:
        pytest.skip(f"Slurm is not installed ({', '.join(missing)}): bash scripts/install.sh installs it")
    root = Path(tempfile.mkdtemp(prefix="vigil-mh-slurm-"))
    for sub in ("munge", "state", "spool", "log", *(f"spool/{h.hostname}" for h in network.hosts)):
        (root / sub).mkdir(mode=0o700)
    key = root / "munge" / "munge.key"
    key.write_bytes(os.urandom(1024))
    key.chmod(0o400)
    conf = root / "slurm.conf"
    conf.write_text(slurm_conf(root, network))
    cluster = SlurmCluster(root, conf, network.hosts[0].hostname)
    logs = (root / "log" / "daemons.out").open("ab")
    procs: list[subprocess.Popen[bytes]] = []
    try:
        head = network.hosts[0]
        procs.append(start_munged(head.popen, cluster, key, logs))
        procs.append(
            head.popen(
                ["slurmctld", "-D", "-c", "-f", str(conf)],
                env=cluster.env,
                stdout=logs,
                stderr=subprocess.STDOUT,
            )
        )
        for host in network.hosts:
            procs.append(
                host.popen(
                    ["slurmd", "-D", "-N", host.hostname, "-f", str(conf)],
                    env=cluster.env,
                    stdout=logs,
                    stderr=subprocess.STDOUT,
                )
            )
        names = ",".join(h.hostname for h in network.hosts)
        deadline = time.monotonic() + 60
        while True:
            states = subprocess.run(
                ["sinfo", "--noheader", "--Node", "--format=%T", "--nodes", names],
                env=cluster.env, capture_output=True, text=True, timeout=30,
            ).stdout.split()  # fmt: skip
            if states == ["idle"] * len(network.hosts):
                break
            dead = [p.args for p in procs if p.poll() is not None]
            assert not dead and time.monotonic() < deadline, (
                f"nodes {states}, exited {dead}\n{cluster.logs()}"
            )
            time.sleep(0.2)  # polling sinfo until both nodes register idle
        yield cluster
    finally:
        if len(procs) == 2 + len(network.hosts):  # end what still runs, so no slurmstepd outlives its slurmd
            with contextlib.suppress(subprocess.TimeoutExpired):
                subprocess.run(
                    ["scancel", "--partition=vigil"], env=cluster.env, capture_output=True, timeout=10
                )
        for proc in reversed(procs):
            stop_daemon(proc)
        logs.close()
        shutil.rmtree(root, ignore_errors=True)


def sbatch(cluster: SlurmCluster, plane: Plane, work: Path, spec: dict[str, Any]) -> str:
    """The example batch script (2 nodes, as it says), against this module's control plane."""
    return cluster.sbatch(work, spec, nats_url=plane.nats_url, api_url=plane.url, token=TOKEN)


def spec(name: str, steps: int) -> dict[str, Any]:
    return {
        "name": name,
        "resources": {"nodes": 2, "gpus_per_node": 1},
        "model": TINY,
        "train": {"steps": steps, **TRAIN},
        "checkpoint": {"every": 4},
    }


def workers_in(host: Host) -> list[int]:
    """The `vigil slurm worker` processes running in `host`."""
    found = []
    for pid in host.pids():
        try:
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"slurm" in argv and b"worker" in argv:
            found.append(pid)
    return found


async def test_a_two_node_sbatch_job_runs_a_rank_on_each_host_and_completes(
    plane: Plane, slurm_hosts: SlurmCluster, network: Network, tmp_path: Path
) -> None:
    a, b = network.hosts
    name = "mh-slurm-ok-" + uuid.uuid4().hex[:6]
    slurm_id = sbatch(slurm_hosts, plane, tmp_path, spec(name, steps=6))
    job_id = await slurm_hosts.vigil_job(plane.http, name, tmp_path, slurm_id)
    launch = await launched(plane.bus, job_id, timeout_s=60)
    nodes = [worker_name(h.hostname, slurm_id) for h in (a, b)]
    assert [(p.rank, p.node) for p in launch.placement] == [(0, nodes[0]), (1, nodes[1])]
    assert launch.master_addr == a.address  # hosta's Slurm node name, resolved on hosta
    try:
        await wait_state(plane.bus, job_id, "SUCCEEDED", timeout_s=240)
    except TimeoutError:
        raise AssertionError(slurm_hosts.output(tmp_path, slurm_id)) from None
    assert await slurm_hosts.ended(slurm_id) == "COMPLETED", slurm_hosts.output(tmp_path, slurm_id)
    assert slurm_hosts.steps(slurm_id) == []
    assert not workers_in(a) and not workers_in(b)


async def test_a_worker_that_dies_fails_vigil_slurm_run_and_its_allocation(
    plane: Plane, slurm_hosts: SlurmCluster, network: Network, tmp_path: Path
) -> None:
    a, b = network.hosts
    name = "mh-slurm-dies-" + uuid.uuid4().hex[:6]
    slurm_id = sbatch(slurm_hosts, plane, tmp_path, spec(name, steps=5000))
    job_id = await slurm_hosts.vigil_job(plane.http, name, tmp_path, slurm_id)
    await next_event(
        plane.bus, subjects.job_status(job_id), lambda e: isinstance(e, RankStarted), timeout_s=120
    )
    await next_event(
        plane.bus, subjects.job_steps(job_id), lambda e: isinstance(e, StepCompleted), timeout_s=120
    )

    (victim,) = workers_in(b)
    os.kill(victim, signal.SIGKILL)  # hostb's worker dies

    assert await slurm_hosts.ended(slurm_id) == "FAILED", slurm_hosts.output(tmp_path, slurm_id)
    out = (tmp_path / f"slurm-{slurm_id}.out").read_text()
    assert f"before Vigil job {job_id} did: a worker of this allocation died" in out, out
    await wait_state(plane.bus, job_id, "CANCELLED", timeout_s=30)
    assert slurm_hosts.steps(slurm_id) == []
    assert not workers_in(a) and not workers_in(b)
