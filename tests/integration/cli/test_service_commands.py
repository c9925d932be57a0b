"""`vigil scheduler|telemetry|guardian|worker`: one path for every service, and the control plane runs
without the worker's dependencies (torch, DeepSpeed, NVML, numpy, matplotlib), as its slim images do.

Each service is a real `vigil` process here, started the way a user or compose starts it, with an
import guard in front that refuses the worker's dependencies and says so in the log.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import nats.js.errors
import pytest

from tests.helpers import eventually
from tests.integration.scheduler.conftest import fresh_database
from vigil_common import credentials, subjects
from vigil_common.bus import Bus
from vigil_common.embedded import EmbeddedNats, free_port

pytestmark = pytest.mark.integration

WORKER_ONLY = ("torch", "deepspeed", "pynvml", "numpy", "matplotlib")
SLIM = f"""
import importlib.abc, sys
class WorkerOnly(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in {WORKER_ONLY!r}:
            print(f"slim install: refused import of {{name}}", file=sys.stderr, flush=True)
            raise ImportError(f"{{name}} is not part of the slim install")
sys.meta_path.insert(0, WorkerOnly())
from vigil_cli.main import main
sys.argv = ["vigil", *sys.argv[1:]]
main()
"""
TOKEN = "service-commands-token-0123"


def vigil(*args: str, env: dict[str, str], cwd: Path, **kw: object) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-c", SLIM, *args],
        env=env,
        cwd=cwd,
        text=True,
        **kw,  # type: ignore[call-overload]
    )


def clean_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("VIGIL_")}
    env.update(extra)
    return env


@pytest.mark.parametrize(
    ("command", "env", "named"),
    [
        ("scheduler", {"VIGIL_API_TOKEN": "short"}, "VIGIL_API_TOKEN"),
        ("telemetry", {"VIGIL_API_TOKEN": "short"}, "VIGIL_API_TOKEN"),
        ("guardian", {"VIGIL_API_TOKEN": "short"}, "VIGIL_API_TOKEN"),
        ("worker", {"VIGIL_CPU_SLOTS": "0"}, "VIGIL_CPU_SLOTS"),
        ("guardian", {}, "VIGIL_NATS_URL and VIGIL_DATABASE_URL"),
        ("worker", {}, "VIGIL_NATS_URL"),
        ("telemetry", {"VIGIL_NATS_URL": "nats://127.0.0.1:1", "VIGIL_DATABASE_URL": "postgresql://x@127.0.0.1:1/x",
                       "VIGIL_CONNECT_TIMEOUT_S": "1"}, "cannot reach Postgres"),
    ],
)  # fmt: skip
def test_a_bad_setting_is_one_line_naming_it_and_exit_1(
    command: str, env: dict[str, str], named: str, tmp_path: Path
) -> None:
    proc = vigil(command, env=clean_env(**env), cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    _out, err = proc.communicate(timeout=120)
    errors = [line for line in err.splitlines() if line.startswith("Error: ")]
    assert proc.returncode == 1, err
    assert "Traceback" not in err and len(errors) == 1 and named in errors[0], err
    assert "slim install: refused" not in err, err


@pytest.fixture
def own_nats(server_dir: Path) -> Iterator[str]:
    with EmbeddedNats(server_dir / "nats") as server:
        yield server.url


async def test_the_control_plane_runs_without_the_worker_dependencies(
    own_nats: str, database_url: str, tmp_path: Path
) -> None:
    db = await fresh_database(database_url)
    http_port, metrics_port = free_port(), free_port()
    env = clean_env(
        VIGIL_NATS_URL=own_nats,
        VIGIL_DATABASE_URL=db,
        VIGIL_API_TOKEN=TOKEN,
        VIGIL_HTTP_PORT=str(http_port),
        VIGIL_METRICS_PORT=str(metrics_port),
    )
    logs = {name: tmp_path / f"{name}.log" for name in ("scheduler", "telemetry", "guardian")}
    procs: dict[str, subprocess.Popen[str]] = {}
    try:
        for name, log in logs.items():
            with log.open("w") as out:
                procs[name] = vigil(name, env=env, cwd=tmp_path, stdout=out, stderr=subprocess.STDOUT)

        async def answers(url: str) -> bool:
            for name, p in procs.items():
                assert p.poll() is None, f"{name} exited: {logs[name].read_text()[-3000:]}"
            with contextlib.suppress(httpx.HTTPError):
                async with httpx.AsyncClient(timeout=2) as http:
                    return (await http.get(url, headers={"Authorization": f"Bearer {TOKEN}"})).is_success
            return False

        await eventually(lambda: answers(f"http://127.0.0.1:{http_port}/api/v1/jobs"), what="the gateway")
        await eventually(lambda: answers(f"http://127.0.0.1:{metrics_port}/metrics"), what="telemetry")
        bus = await Bus.connect(own_nats, "test-slim")
        try:

            async def guardian_consumes() -> bool:
                assert procs["guardian"].poll() is None, logs["guardian"].read_text()[-3000:]
                try:
                    await bus.js.consumer_info(subjects.JOBS.name, credentials.guardian_input(0))
                except nats.js.errors.NotFoundError:
                    return False
                return True

            await eventually(guardian_consumes, what="the guardian's step consumer")
        finally:
            await bus.close()
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        codes = {name: await asyncio.to_thread(p.wait, 30) for name, p in procs.items()}
    for name, log in logs.items():
        text = log.read_text()
        assert codes[name] == 0, f"{name} exited {codes[name]}: {text[-3000:]}"
        assert "slim install: refused" not in text and "Traceback" not in text, text[-3000:]


def _a_backend_that_finds_no_gpu() -> str | None:
    """A VIGIL_GPU_BACKEND this machine's worker refuses (no GPU through it), or None."""
    from vigil.errors import ConfigError
    from vigil_worker.inventory import Inventory

    for backend in ("nvml", "amdsmi"):
        try:
            Inventory.discover(1, "probe", backend)
        except ConfigError:
            return backend
    return None


@pytest.mark.parametrize("setting", ["VIGIL_HTTP_PORT", "VIGIL_GPU_BACKEND"])
def test_vigil_up_with_a_service_that_cannot_start_is_one_line_naming_the_setting(
    setting: str, tmp_path: Path
) -> None:
    """`vigil up` runs the services in one process: a setting one of them cannot start with (the
    scheduler's port taken, the worker's GPU backend finding no GPU) stops the others cleanly and ends
    the command with one `Error:` line naming it, exit 1, and no traceback (theirs neither)."""
    env = clean_env(VIGIL_HTTP_PORT=str(free_port()), VIGIL_METRICS_PORT="0")
    with contextlib.ExitStack() as stack:
        if setting == "VIGIL_HTTP_PORT":
            taken = stack.enter_context(socket.create_server(("127.0.0.1", 0)))
            env[setting] = str(taken.getsockname()[1])
        elif (backend := _a_backend_that_finds_no_gpu()) is None:
            pytest.skip("every GPU backend finds a GPU here")
        else:
            env[setting] = backend
        proc = subprocess.run(
            [sys.executable, "-c", "from vigil_cli.main import main; main()", "up", "--data-dir", "d"],
            env=env,
            cwd=tmp_path,
            capture_output=True,
            text=True,
            timeout=180,
        )
    errors = [line for line in proc.stderr.splitlines() if line.startswith("Error: ")]
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert len(errors) == 1 and setting in errors[0], proc.stderr[-3000:]
