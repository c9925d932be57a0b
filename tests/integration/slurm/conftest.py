"""A real one-node Slurm cluster for the tests: munged, slurmctld and slurmd from Debian's packages,
run as root in a temp folder with their own ports, no cgroups (this is a container), torn down after.

The configuration is the smallest that runs jobs here: processes tracked by /proc (proctrack/linuxproc),
no task binding (task/none), no accounting, consumable CPUs (select/cons_tres, CR_CPU) and a node of
`CPUS` CPUs without GRES; `SlurmdParameters=config_overrides` lets the node claim more CPUs than the
machine has, so the tests run the same on 2 cores as on 64.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

import httpx
import pytest
import yaml

from tests.helpers import eventually
from vigil_common.embedded import free_port

CPUS = 4
SBATCH_SCRIPT = Path(__file__).resolve().parents[3] / "deploy" / "slurm" / "vigil-job.sbatch"
BINARIES = ("munged", "slurmctld", "slurmd", "sbatch", "srun", "squeue", "sinfo", "scontrol")


@dataclass
class SlurmCluster:
    root: Path
    conf: Path
    node: str

    @property
    def env(self) -> dict[str, str]:
        """The environment a Slurm client command needs (and passes on to the jobs it submits)."""
        return {**os.environ, "SLURM_CONF": str(self.conf)}

    def run(self, *argv: str, timeout: float = 30) -> str:
        done = subprocess.run(argv, env=self.env, capture_output=True, text=True, timeout=timeout)
        assert done.returncode == 0, f"{' '.join(argv)}: {done.stderr or done.stdout}"
        return done.stdout

    def job_state(self, job_id: str) -> str | None:
        """The job's state from slurmctld (it keeps ended jobs for MinJobAge), None if unknown."""
        done = subprocess.run(
            ["scontrol", "-o", "show", "job", job_id],
            env=self.env,
            capture_output=True,
            text=True,
            timeout=30,
        )
        for field in done.stdout.split():
            if field.startswith("JobState="):
                return field.removeprefix("JobState=")
        return None

    def steps(self, job_id: str) -> list[str]:
        """The job's running steps (`squeue --steps`), e.g. ["12.0", "12.batch"]."""
        out = self.run("squeue", "--steps", "--noheader", "--jobs", job_id, "--format=%i")
        return out.split()

    def logs(self) -> str:
        return "\n".join(
            f"== {p.name}\n" + p.read_text(errors="replace")[-3000:] for p in sorted(self.root.glob("log/*"))
        )

    def output(self, work: Path, slurm_id: str) -> str:
        """The batch job's output (written under `work`) and the daemons' logs: what a failure shows."""
        out = work / f"slurm-{slurm_id}.out"
        return f"{out.read_text() if out.exists() else 'no output'}\n{self.logs()}"

    def sbatch(
        self,
        work: Path,
        spec: dict[str, Any],
        *,
        nats_url: str,
        api_url: str,
        token: str,
        args: tuple[str, ...] = (),
    ) -> str:
        """Submit the example batch script (`deploy/slurm/vigil-job.sbatch`) with `spec` and sbatch's
        `args`, against the control plane at `api_url`; the Slurm job id."""
        spec_file = work / f"{spec['name']}.yaml"
        spec_file.write_text(yaml.safe_dump(spec))
        env = {k: v for k, v in self.env.items() if not k.startswith("VIGIL_")}
        env.update(
            PATH=f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}",
            VIGIL_NATS_URL=nats_url,
            VIGIL_API_URL=api_url,
            VIGIL_API_TOKEN=token,
            VIGIL_DATA_DIR=str(work / "vigil"),  # storage the nodes share
            VIGIL_HEARTBEAT_INTERVAL_S="0.5",
            OMP_NUM_THREADS="1",
        )
        argv = ["sbatch", "--parsable", *args, f"--chdir={work}", f"--output={work}/slurm-%j.out"]
        done = subprocess.run(
            [*argv, str(SBATCH_SCRIPT), str(spec_file)], env=env, capture_output=True, text=True, timeout=30
        )
        assert done.returncode == 0, done.stderr
        return done.stdout.strip().split(";")[0]

    async def vigil_job(self, http: httpx.AsyncClient, name: str, work: Path, slurm_id: str) -> str:
        """The id of the Vigil job named `name` that Slurm job `slurm_id` submitted, once it is there."""

        async def submitted() -> str | None:
            items = (await http.get("/api/v1/jobs", params={"limit": 100})).json()["items"]
            return next((j["id"] for j in items if j["name"] == name), None)

        try:
            return await eventually(submitted, timeout=120, what=f"the Vigil job of Slurm job {slurm_id}")
        except AssertionError:
            raise AssertionError(self.output(work, slurm_id)) from None

    async def ended(self, slurm_id: str) -> str:
        """The Slurm job's state once it has ended."""

        async def state() -> str | None:
            found = self.job_state(slurm_id)
            return found if found not in (None, "PENDING", "RUNNING", "COMPLETING") else None

        return await eventually(state, timeout=90, what=f"Slurm job {slurm_id} to end")


def start_munged(
    popen: Callable[..., subprocess.Popen[bytes]], cluster: SlurmCluster, key: Path, logs: IO[bytes]
) -> subprocess.Popen[bytes]:
    """munged for `cluster` (started by `popen`: here, or in a host), once its socket is there."""
    root = cluster.root
    munge = root / "munge"
    proc = popen(
        ["munged", "--foreground", "--force", f"--key-file={key}",
         f"--socket={munge / 'munge.socket'}", f"--pid-file={munge / 'munged.pid'}",
         f"--seed-file={munge / 'seed'}", f"--log-file={root / 'log' / 'munged.log'}"],
        stdout=logs, stderr=subprocess.STDOUT,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 15
        while not (munge / "munge.socket").exists():
            assert proc.poll() is None and time.monotonic() < deadline, cluster.logs()
            time.sleep(0.05)  # polling for the socket munged creates
    except BaseException:
        stop_daemon(proc)
        raise
    return proc


# What every test cluster's slurm.conf says besides its hosts, ports, files and nodes (here and in
# tests/integration/multihost).
COMMON_CONF = """\
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
MpiDefault=none
SwitchType=switch/none
ReturnToService=2
SlurmdParameters=config_overrides
MinJobAge=600
"""


def _slurm_conf(root: Path, node: str) -> str:
    return f"""\
ClusterName=vigiltest
SlurmctldHost={node}(127.0.0.1)
SlurmctldPort={free_port()}
SlurmdPort={free_port()}
AuthInfo=socket={root}/munge/munge.socket
StateSaveLocation={root}/state
SlurmdSpoolDir={root}/spool
SlurmctldPidFile={root}/slurmctld.pid
SlurmdPidFile={root}/slurmd.pid
SlurmctldLogFile={root}/log/slurmctld.log
SlurmdLogFile={root}/log/slurmd.log
{COMMON_CONF}KillWait=10
NodeName={node} NodeAddr=127.0.0.1 CPUs={CPUS} State=UNKNOWN
PartitionName=vigil Nodes=ALL Default=YES MaxTime=INFINITE State=UP
"""


def stop_daemon(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@pytest.fixture(scope="session")
def slurm_cluster() -> Iterator[SlurmCluster]:
    missing = [b for b in BINARIES if not shutil.which(b)]
    if missing:
        pytest.skip(f"Slurm is not installed ({', '.join(missing)}): bash scripts/install.sh installs it")
    if os.geteuid() != 0:
        pytest.skip("the Slurm fixture runs slurmd as root (SlurmdUser=root)")
    root = Path(tempfile.mkdtemp(prefix="vigil-slurm-"))
    for sub in ("munge", "state", "spool", "log"):
        (root / sub).mkdir(mode=0o700)
    key = root / "munge" / "munge.key"
    key.write_bytes(os.urandom(1024))
    key.chmod(0o400)
    node = socket.gethostname().split(".")[0]
    conf = root / "slurm.conf"
    conf.write_text(_slurm_conf(root, node))
    cluster = SlurmCluster(root, conf, node)
    logs = (root / "log" / "daemons.out").open("ab")
    procs: list[subprocess.Popen[bytes]] = []
    try:
        procs.append(start_munged(subprocess.Popen, cluster, key, logs))
        for daemon in (["slurmctld", "-D", "-c"], ["slurmd", "-D", "-N", node]):
            procs.append(
                subprocess.Popen(
                    [*daemon, "-f", str(conf)], env=cluster.env, stdout=logs, stderr=subprocess.STDOUT
                )
            )
        deadline = time.monotonic() + 60
        while True:
            state = subprocess.run(
                ["sinfo", "--noheader", "--format=%T", "--nodes", node],
                env=cluster.env, capture_output=True, text=True, timeout=30,
            ).stdout.strip()  # fmt: skip
            if state == "idle":
                break
            dead = [p.args[0] for p in procs if p.poll() is not None]
            assert not dead and time.monotonic() < deadline, (
                f"node {state!r}, exited {dead}\n{cluster.logs()}"
            )
            time.sleep(0.2)  # polling sinfo until the node registers idle
        yield cluster
    finally:
        if len(procs) == 3:  # end what still runs, so no slurmstepd outlives its slurmd
            subprocess.run(["scancel", "--partition=vigil"], env=cluster.env, capture_output=True, timeout=30)
        for proc in reversed(procs):
            stop_daemon(proc)
        logs.close()
        shutil.rmtree(root, ignore_errors=True)
