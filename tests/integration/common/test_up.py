"""`vigil up` starts the infrastructure, says where it listens, and Ctrl-C stops everything."""

from __future__ import annotations

import os
import re
import selectors
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration


def read_until(proc: subprocess.Popen[str], marker: str, timeout: float) -> str:
    out = ""
    sel = selectors.DefaultSelector()
    sel.register(proc.stdout, selectors.EVENT_READ)
    deadline = time.monotonic() + timeout
    while marker not in out:
        remaining = deadline - time.monotonic()
        if remaining <= 0 or proc.poll() is not None:
            if proc.poll() is not None:
                out += proc.stdout.read()
            raise AssertionError(f"no {marker!r} from vigil up; output so far:\n{out}")
        if sel.select(remaining):
            line = proc.stdout.readline()
            out += line
    return out


def test_vigil_up_runs_and_stops_cleanly(server_dir: Path):
    env = {k: v for k, v in os.environ.items() if k not in ("VIGIL_NATS_URL", "VIGIL_DATABASE_URL")}
    env["VIGIL_DATA_DIR"] = str(server_dir / "data")
    env["VIGIL_HTTP_PORT"] = "0"
    vigil = Path(sys.executable).parent / "vigil"
    proc = subprocess.Popen(
        [str(vigil), "up"], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    try:
        out = read_until(proc, "Ctrl-C to stop", 90)
        nats_port = int(re.search(r"NATS\s+nats://(?:\S+@)?127\.0\.0\.1:(\d+)", out).group(1))
        pg_port = int(re.search(r"Postgres\s+postgresql://\S+:(\d+)/", out).group(1))
        for port in (nats_port, pg_port):
            socket.create_connection(("127.0.0.1", port), timeout=2).close()
        proc.send_signal(signal.SIGINT)
        rest, _ = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, rest
    assert "stopped cleanly" in rest
    for port in (nats_port, pg_port):
        with socket.socket() as s:
            assert s.connect_ex(("127.0.0.1", port)) != 0, f"port {port} still listening after Ctrl-C"
    assert not (server_dir / "data" / "endpoints.json").exists()


def test_vigil_help_lists_only_working_commands():
    vigil = str(Path(sys.executable).parent / "vigil")
    out = subprocess.run([vigil, "--help"], capture_output=True, text=True, timeout=60, check=True).stdout
    commands = re.findall(r"^  (\S+)\s", out.split("Commands:")[1], flags=re.M)
    assert {"up", "bench"} <= set(commands)
    # every listed command at least parses its own options: in this process (the entry point above is the
    # installed script's; a process a command imports ~1 s each, 24 s for all of them)
    from click.testing import CliRunner

    from vigil_cli.main import cli

    for name in commands:
        result = CliRunner().invoke(cli, [name, "--help"], prog_name="vigil")
        assert result.exit_code == 0 and "Usage:" in result.output, (name, result.output, result.exception)
