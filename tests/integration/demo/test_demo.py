"""`vigil demo` end to end, as a newcomer runs it (fewer steps): real services, ranks, faults."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.integration, pytest.mark.slow]


def test_the_demo_rescues_its_run_and_stays_up_with_its_console(server_dir: Path):
    import signal

    import httpx

    env = {k: v for k, v in os.environ.items() if not k.startswith("VIGIL_")}
    vigil = Path(sys.executable).parent / "vigil"
    proc = subprocess.Popen(
        [str(vigil), "demo", "--steps", "40", "--json", "--stay", "--data-dir", str(server_dir / "demo")],
        env=env,
        stdout=subprocess.PIPE,
        stderr=(server_dir / "demo-stderr.log").open("w"),
        text=True,
    )
    try:
        line = proc.stdout.readline()  # the summary, printed before --stay waits (timeout: pytest's)
        assert line.strip(), (server_dir / "demo-stderr.log").read_text()[-4000:]
        summary = json.loads(line)
        # --stay: the stack and its web console are still up after the run
        console = httpx.get(summary["console"], headers={"Accept": "text/html"})
        assert console.status_code == 302 and "/login" in console.headers["location"]
        assert proc.poll() is None
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=90)
    finally:
        if proc.poll() is None:
            proc.kill()
    stderr = (server_dir / "demo-stderr.log").read_text()
    assert "web console http://127.0.0.1:" in stderr and "--stay: the stack stays up" in stderr
    assert summary["state"] == "SUCCEEDED", stderr[-4000:]
    kinds = {i["kind"] for i in summary["incidents"]}
    assert {i["rank"] for i in summary["incidents"] if i["kind"] == "nan"} == {1}  # injected on rank 1
    assert {"nan", "spike"} <= kinds
    assert all(f["caught"] for f in summary["faults"]) and len(summary["faults"]) == 2
    # the held steps, attributed without a rollback: the NaN on rank 1 was transient (its replay was
    # clean), the spike in rank 0's data came back in the replay and its data window was skipped
    held = {h["kind"]: h for h in summary["held_steps"]}
    assert held["nan"]["action"] == "replay" and "replay clean" in held["nan"]["attribution"]
    assert held["spike"]["action"] == "skip" and "skipped" in held["spike"]["attribution"]
    assert summary["rollbacks"] == []
    assert summary["ok"] is True and proc.returncode == 0
    assert Path(summary["plot"]).stat().st_size > 10_000
    assert summary["last_step"] == 39
    assert summary["flops_per_token"] > 0 and summary["median_mfu"] > 0  # CPU: against a measured rate


def _processes_mentioning(text: str) -> list[str]:
    found = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            cmdline = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if text in cmdline:
            found.append(f"{proc.name}: {cmdline[:200]}")
    return found


def test_ctrl_c_mid_run_leaves_no_process_behind(server_dir: Path):
    import signal
    import time

    data = server_dir / "demo"
    env = {k: v for k, v in os.environ.items() if not k.startswith("VIGIL_")}
    vigil = Path(sys.executable).parent / "vigil"
    proc = subprocess.Popen(
        [str(vigil), "demo", "--steps", "400", "--data-dir", str(data)],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 180
        # ranks are training once the first periodic checkpoint exists
        while not list((data / "checkpoints").glob("*/step_00000005")):
            assert proc.poll() is None, "the demo ended before training started"
            assert time.monotonic() < deadline, "no checkpoint within 180s"
            time.sleep(0.2)  # polling the file system for the ranks' progress, bounded by the deadline
        assert _processes_mentioning(str(data))  # servers and ranks are running
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=90)
    finally:
        if proc.poll() is None:
            proc.kill()
    deadline = time.monotonic() + 10
    while (left := _processes_mentioning(str(data))) and time.monotonic() < deadline:
        time.sleep(0.1)  # processes that got their signal may take a moment to be reaped
    assert not left, "left behind:\n" + "\n".join(left)
    assert proc.returncode != 0  # interrupted: not a success
