"""`vigil slurm`: Vigil workers on the nodes of a Slurm allocation.

Two shapes, one worker per node in both (an `srun` step of one task per node):

- `vigil slurm workers`, in a long-lived allocation (`sbatch`/`salloc`): the allocation's nodes join
  the fleet for as long as it lasts and host any number of Vigil jobs.
- `vigil slurm run SPEC`, as an `sbatch` script's one command: start the workers, submit SPEC, follow
  it, and end the step (and so the allocation) when the Vigil job ends; `scancel` of the allocation
  cancels the Vigil job.

Inside the step, `vigil slurm worker` reads the allocation from Slurm's environment (`SLURMD_NODENAME`,
`SLURM_JOB_ID`, `SLURM_CPUS_ON_NODE`, ...): the node's name and slots, and its address for the ranks'
rendezvous (what the node's name resolves to, or where that is a loopback address, as Debian's /etc/hosts
makes a machine's own name, the address the node reaches NATS from). The scheduler then places ranks on
those workers like on any other; their processes are children of the worker, so they live and die inside
the Slurm step.
"""

from __future__ import annotations

import contextlib
import ipaddress
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import click
from rich.console import Console

from vigil.client import Client, VigilError
from vigil.errors import ConfigError
from vigil.jobstates import JobState
from vigil_cli.jobs import connect, follow_job, url_option
from vigil_cli.services import serve
from vigil_common.addresses import source_address

_RANGE = re.compile(r"^(\d+)(?:-(\d+))?$")
WORKER_STOP_GRACE_S = 30.0  # after SIGTERM to the step, before SIGKILL


def expand_hostlist(text: str) -> list[str]:
    """Slurm's compact host list as names: `gpu[01-03,7],login` -> gpu01, gpu02, gpu03, gpu7, login.

    Zero padding is kept (`[08-10]` -> 08, 09, 10); several bracket groups multiply (`r[1-2]n[1-2]`)."""
    hosts: list[str] = []
    for item in _split_top_level(text.strip()):
        hosts += _expand_one(item)
    return hosts


def _split_top_level(text: str) -> list[str]:
    items, depth, start = [], 0, 0
    for i, ch in enumerate(text):
        depth += {"[": 1, "]": -1}.get(ch, 0)
        if depth < 0:
            raise ConfigError(f"host list {text!r}: unbalanced ']' at {i}")
        if ch == "," and depth == 0:
            items.append(text[start:i])
            start = i + 1
    if depth:
        raise ConfigError(f"host list {text!r}: unclosed '['")
    items.append(text[start:])
    return [item for item in items if item]


def _expand_one(item: str) -> list[str]:
    head, bracket, rest = item.partition("[")
    if not bracket:
        return [item]
    body, _, tail = rest.partition("]")
    names = []
    for part in body.split(","):
        m = _RANGE.match(part)
        if not m:
            raise ConfigError(f"host list {item!r}: {part!r} is not a number or a range a-b")
        lo, hi = m.group(1), m.group(2) or m.group(1)
        width = len(lo) if lo.startswith("0") else 0
        names += [f"{head}{n:0{width}d}" for n in range(int(lo), int(hi) + 1)]
    return [name + suffix for name in names for suffix in _expand_one(tail)]


@dataclass(frozen=True)
class Allocation:
    """What Slurm tells a task about its allocation and node."""

    job_id: str
    nodes: list[str]
    node: str | None  # this task's node; None in the batch script before any step
    cpus_on_node: int
    gpus_on_node: int

    @classmethod
    def from_env(cls, env: Mapping[str, str]) -> Allocation:
        """From Slurm's variables; a ConfigError naming the variable when one is missing."""
        job_id = env.get("SLURM_JOB_ID") or env.get("SLURM_JOBID")
        if not job_id:
            raise ConfigError("SLURM_JOB_ID is not set: run this inside a Slurm allocation (sbatch, salloc)")
        nodelist = env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST")
        if not nodelist:
            raise ConfigError("SLURM_JOB_NODELIST is not set: run this inside a Slurm allocation")
        return cls(
            job_id=job_id,
            nodes=expand_hostlist(nodelist),
            node=env.get("SLURMD_NODENAME"),
            cpus_on_node=_count(env, "SLURM_CPUS_ON_NODE", 1),
            gpus_on_node=_count(env, "SLURM_GPUS_ON_NODE", 0),
        )


def _count(env: Mapping[str, str], name: str, default: int) -> int:
    value = env.get(name, "").strip()
    if not value:
        return default
    if not value.isdigit():
        raise ConfigError(f"{name}={value!r}: expected a whole number")
    return int(value)


def worker_name(node: str, job_id: str) -> str:
    """A worker's Vigil node name: the Slurm node and allocation, so two allocations sharing a node
    run two workers that never take each other's launches."""
    return re.sub(r"[^A-Za-z0-9_-]", "-", f"{node.split('.')[0]}-{job_id}")[:64]


def worker_overrides(alloc: Allocation, env: Mapping[str, str]) -> dict[str, Any]:
    """The worker's settings inside a Slurm step; VIGIL_* variables set by the user still win."""
    if alloc.node is None:
        raise ConfigError("SLURMD_NODENAME is not set: `vigil slurm worker` runs as a task of an srun step")
    overrides: dict[str, Any] = {
        # the step ends with the allocation: its ranks must end with it, not outlive it
        "worker_end_ranks_on_stop": True,
    }
    if "VIGIL_NODE_NAME" not in env:
        overrides["node_name"] = worker_name(alloc.node, alloc.job_id)
    if "VIGIL_CPU_SLOTS" not in env:
        overrides["cpu_slots"] = max(1, alloc.cpus_on_node)
    if "VIGIL_NODE_ADDRESS" not in env:
        address = node_address(alloc.node)
        if ipaddress.ip_address(address).is_loopback:  # Debian's /etc/hosts: the own name is 127.0.1.1
            address = source_address(env.get("VIGIL_NATS_URL")) or address
        overrides["node_address"] = address
    return overrides


def node_address(node: str) -> str:
    """The address the other nodes' ranks reach this one at (the ranks' rendezvous)."""
    try:
        return socket.gethostbyname(node)
    except OSError as exc:
        raise ConfigError(
            f"cannot resolve Slurm node {node!r} ({exc}); set VIGIL_NODE_ADDRESS for the worker"
        ) from exc


def worker_step_argv(alloc: Allocation, vigil: str) -> list[str]:
    """The srun command that runs one `vigil slurm worker` on every node of the allocation, with all of
    each node's CPUs and GPUs (the ranks it starts share them)."""
    argv = [
        "srun",
        f"--nodes={len(alloc.nodes)}",
        "--ntasks-per-node=1",
        f"--cpus-per-task={max(1, alloc.cpus_on_node)}",
        "--kill-on-bad-exit=1",
        "--job-name=vigil-workers",
    ]
    if alloc.gpus_on_node:
        argv.append(f"--gpus-per-task={alloc.gpus_on_node}")
    return [*argv, vigil, "slurm", "worker"]


def _vigil_executable() -> str:
    beside = Path(sys.executable).parent / "vigil"
    return str(beside) if beside.exists() else "vigil"


def _stop_step(step: subprocess.Popen[bytes]) -> int:
    """End the workers' step: SIGTERM (srun forwards it to the workers, which end their ranks), then
    SIGKILL after a grace period."""
    if step.poll() is None:
        step.send_signal(signal.SIGTERM)
        try:
            step.wait(WORKER_STOP_GRACE_S)
        except subprocess.TimeoutExpired:
            step.kill()
            step.wait()
    return step.returncode


def _wait_workers(client: Client, names: set[str], step: subprocess.Popen[bytes], timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        alive = {n.name for n in client.nodes().items if n.alive}
        if names <= alive:
            return
        if step.poll() is not None:
            raise click.ClickException(f"the workers' srun step ended with code {step.returncode}")
        if time.monotonic() > deadline:
            raise click.ClickException(
                f"workers {sorted(names - alive)} did not register in {timeout_s:.0f}s: "
                "can the nodes reach VIGIL_NATS_URL?"
            )
        time.sleep(0.5)  # polling the gateway for the workers' first heartbeats


class _Terminated(Exception):
    """SIGTERM reached `vigil slurm run` (scancel, or the allocation's time limit)."""


class StepEnded(click.ClickException):
    """The workers' srun step ended while their Vigil job still ran: a worker died (srun ends the step when
    a task fails, `--kill-on-bad-exit`), or the step was ended from outside."""

    def __init__(self, code: int, job_id: str) -> None:
        how = f"killed by signal {-code}" if code < 0 else f"exit code {code}"
        super().__init__(
            f"the workers' srun step ended ({how}) before Vigil job {job_id} did: a worker of this "
            "allocation died or was stopped (its output is in this Slurm job's); the Vigil job was cancelled"
        )
        self.code = code


def follow_while_step_runs(
    follow: Callable[[], str], step: subprocess.Popen[bytes], job_id: str, on_step_end: Callable[[], None]
) -> str:
    """`follow()` (which returns the job's final state) as long as the workers' step runs; the final state.

    The step ending first calls `on_step_end` (which cancels the job) and raises StepEnded. Signals still
    reach this (the main) thread: `follow` and the wait on the step run in threads of their own."""
    outcome: dict[str, Any] = {}
    ended = threading.Event()

    def following() -> None:
        try:
            outcome["state"] = follow()
        except BaseException as exc:  # handed to the main thread
            outcome["error"] = exc
        finally:
            ended.set()

    def watching() -> None:
        step.wait()
        ended.set()

    threading.Thread(target=following, name="follow-job", daemon=True).start()
    threading.Thread(target=watching, name="watch-step", daemon=True).start()
    # woken now and then: a signal's handler runs in this thread even when the signal went to another
    while not ended.wait(1.0):
        pass
    if "state" in outcome:
        return str(outcome["state"])
    if "error" in outcome:
        raise outcome["error"]
    on_step_end()
    raise StepEnded(step.returncode, job_id)


def register(group: click.Group) -> None:
    @group.group("slurm")
    def slurm() -> None:
        """Vigil workers on the nodes of a Slurm allocation (run inside sbatch or salloc)."""

    @slurm.command("worker")
    def worker() -> None:
        """One node's worker, as a task of an srun step: name, slots and address from Slurm."""
        alloc = Allocation.from_env(os.environ)
        serve("vigil_worker.main", **worker_overrides(alloc, os.environ))

    @slurm.command("workers")
    def workers() -> None:
        """A worker on every node of this allocation until it ends (a long-lived allocation)."""
        alloc = Allocation.from_env(os.environ)
        argv = worker_step_argv(alloc, _vigil_executable())
        os.execvp(argv[0], argv)

    @slurm.command("run")
    @click.argument("spec", type=click.Path(exists=True, dir_okay=False, path_type=Path))
    @click.option("--register-timeout", default=120.0, show_default=True, help="seconds for workers")
    @url_option
    def run(spec: Path, register_timeout: float, url: str | None) -> None:
        """Workers on this allocation's nodes, then SPEC submitted and followed; exits when it ends
        (0 if it SUCCEEDED), ending the step. SIGTERM (scancel) cancels the Vigil job; so does the workers'
        step ending first (a worker died), and the command then fails saying so."""
        alloc = Allocation.from_env(os.environ)
        client = connect(url)
        console = Console()
        job_id: str | None = None

        def on_term(signum: int, frame: object) -> None:
            raise _Terminated

        previous = signal.signal(signal.SIGTERM, on_term)
        step = subprocess.Popen(worker_step_argv(alloc, _vigil_executable()))
        try:
            _wait_workers(client, {worker_name(n, alloc.job_id) for n in alloc.nodes}, step, register_timeout)
            job = client.submit(spec)
            job_id = job.id
            console.print(f"submitted {job_id} ({job.name}) from Slurm job {alloc.job_id}")
            submitted = job_id

            def cancel() -> None:
                with contextlib.suppress(VigilError):
                    client.cancel(submitted)

            final = follow_while_step_runs(
                lambda: follow_job(client, submitted, console, json_out=False), step, submitted, cancel
            )
        except _Terminated:
            final = JobState.CANCELLED
            if job_id is not None:
                with contextlib.suppress(VigilError):
                    client.cancel(job_id)
                console.print(f"SIGTERM: cancelled {job_id}")
        finally:
            signal.signal(signal.SIGTERM, previous)
            _stop_step(step)
        raise SystemExit(0 if final == JobState.SUCCEEDED else 1)
