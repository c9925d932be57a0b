"""`vigil slurm run` while its workers' srun step runs: a step that ends before the Vigil job does (a
worker died) cancels the job and fails the command, saying so; the job ending first is its answer; a
signal still reaches the command (scancel's SIGTERM)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import click
import pytest
from click.testing import CliRunner

from vigil.client import VigilError
from vigil_cli import slurm
from vigil_cli.slurm import StepEnded, follow_while_step_runs, worker_name

ENV = {
    "SLURM_JOB_ID": "77",
    "SLURM_JOB_NODELIST": "n[1-2]",
    "SLURM_CPUS_ON_NODE": "1",
}


def step(code: int | None) -> subprocess.Popen[bytes]:
    """A stand-in for the workers' srun step: ends at once with `code`, or runs until killed (None)."""
    body = "import sys; sys.stdin.read()" if code is None else f"raise SystemExit({code})"
    return subprocess.Popen([sys.executable, "-c", body], stdin=subprocess.PIPE)


def end(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        proc.kill()
    proc.wait(10)


def test_a_step_that_ends_first_cancels_the_job_and_says_so() -> None:
    never = threading.Event()
    cancelled: list[str] = []
    proc = step(3)
    with pytest.raises(StepEnded) as caught:
        follow_while_step_runs(lambda: str(never.wait()), proc, "j-1", lambda: cancelled.append("j-1"))
    assert cancelled == ["j-1"]
    assert caught.value.code == 3 and caught.value.exit_code == 1
    assert "srun step ended (exit code 3) before Vigil job j-1 did" in caught.value.message
    assert "a worker of this allocation died" in caught.value.message


def test_a_step_killed_by_a_signal_is_named_so() -> None:
    never = threading.Event()
    proc = step(None)
    proc.kill()
    with pytest.raises(StepEnded, match="killed by signal 9"):
        follow_while_step_runs(lambda: str(never.wait()), proc, "j-1", lambda: None)


def test_the_job_ending_first_is_the_answer() -> None:
    proc = step(None)
    try:
        assert follow_while_step_runs(lambda: "SUCCEEDED", proc, "j-1", lambda: None) == "SUCCEEDED"
        assert proc.poll() is None
    finally:
        end(proc)


def test_an_error_while_following_is_raised_in_the_caller() -> None:
    def broken() -> str:
        raise VigilError("the event stream ended")

    proc = step(None)
    try:
        with pytest.raises(VigilError, match="event stream ended"):
            follow_while_step_runs(broken, proc, "j-1", lambda: None)
    finally:
        end(proc)


class Interrupted(Exception):
    pass


def test_a_signal_still_reaches_the_command_while_it_follows() -> None:
    def on_signal(signum: int, frame: object) -> None:
        raise Interrupted

    never = threading.Event()

    def follow() -> str:
        os.kill(os.getpid(), signal.SIGUSR1)  # to the process, as scancel's SIGTERM arrives, mid-follow
        never.wait()
        return "never"

    previous = signal.signal(signal.SIGUSR1, on_signal)
    proc = step(None)
    try:
        with pytest.raises(Interrupted):
            follow_while_step_runs(follow, proc, "j-1", lambda: None)
    finally:
        signal.signal(signal.SIGUSR1, previous)
        end(proc)


class FakeGateway:
    """What `vigil slurm run` asks of the gateway: the allocation's workers alive, a job that runs until
    cancelled."""

    def __init__(self) -> None:
        self.cancelled: list[str] = []
        self.ended = threading.Event()

    def nodes(self) -> Any:
        names = [worker_name(n, ENV["SLURM_JOB_ID"]) for n in ("n1", "n2")]
        return SimpleNamespace(items=[SimpleNamespace(name=n, alive=True) for n in names])

    def submit(self, spec: Path) -> Any:
        return SimpleNamespace(id="j-77", name="tiny")

    def job(self, job_id: str) -> Any:
        state = "CANCELLED" if self.ended.is_set() else "RUNNING"
        return SimpleNamespace(id=job_id, state=state, last_step=None, loss=None, transitions=[])

    def wait(self, job_id: str, on_event: Any = None) -> Any:
        self.ended.wait(60)
        return self.job(job_id)

    def cancel(self, job_id: str) -> Any:
        self.cancelled.append(job_id)
        self.ended.set()
        return self.job(job_id)


def test_vigil_slurm_run_fails_when_a_worker_dies_before_the_job_ends(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    gateway = FakeGateway()
    monkeypatch.setattr(slurm, "connect", lambda url: gateway)
    # the workers' step: one task dies, srun (--kill-on-bad-exit) ends the step with its code
    monkeypatch.setattr(slurm, "worker_step_argv", lambda alloc, vigil: [sys.executable, "-c", "exit(9)"])
    spec = tmp_path / "job.yaml"
    spec.write_text("name: tiny\n")
    group = click.Group()
    slurm.register(group)
    result = CliRunner().invoke(group, ["slurm", "run", str(spec)], env=ENV)
    assert result.exit_code == 1, result.output
    assert "the workers' srun step ended (exit code 9) before Vigil job j-77 did" in result.output
    assert gateway.cancelled == ["j-77"]
