"""The real stack (`vigil up` in a subprocess, as a user starts it: embedded NATS and Postgres, every
service, a local worker with two CPU slots running real DeepSpeed ranks) and a real Chromium
(Debian's /usr/bin/chromium, driven by Playwright; scripts/install.sh installs it)."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from tests.helpers import eventually
from vigil_common.embedded import free_port
from vigil_common.endpoints import resolve_urls
from vigil_common.settings import Settings

CHROMIUM = "/usr/bin/chromium"
# Without the background-networking switches Chromium's own connections (updates, sync, ...) are refused
# on a closed network and slow every page down.
CHROMIUM_ARGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]


@dataclass
class Stack:
    base_url: str
    token: str
    nats_url: str
    data_dir: Path

    def api(self) -> httpx.AsyncClient:
        return httpx.AsyncClient(
            base_url=self.base_url, headers={"Authorization": f"Bearer {self.token}"}, timeout=10
        )


@pytest.fixture(scope="module")
def screenshots(pytestconfig: pytest.Config) -> Path:
    """Where a person finds the screenshots: the default data dir's `screenshots` (./.vigil/screenshots)."""
    path = pytestconfig.rootpath / ".vigil" / "screenshots"
    path.mkdir(parents=True, exist_ok=True)
    return path


@pytest.fixture(scope="module")
def stack_dir() -> Iterator[Path]:
    path = Path(tempfile.mkdtemp(prefix="vigil-console-"))  # outside pytest's 0700 tree (Postgres)
    path.chmod(0o755)
    yield path
    shutil.rmtree(path, ignore_errors=True)


@dataclass
class UpProcess:
    proc: subprocess.Popen[bytes]
    base_url: str
    data_dir: Path
    log: Path


@pytest.fixture(scope="module")
def up_process(stack_dir: Path) -> Iterator[UpProcess]:
    """`vigil up` as a user starts it, on its own data dir, with the trace file on; SIGINT at the end."""
    data = stack_dir / "data"
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("VIGIL_")}
    env.update(
        VIGIL_DATA_DIR=str(data),
        VIGIL_HTTP_PORT=str(port),
        VIGIL_METRICS_PORT="0",
        VIGIL_TRACE_FILE=str(data / "traces.jsonl"),
        VIGIL_HEARTBEAT_INTERVAL_S="1",
        VIGIL_GPU_SAMPLE_INTERVAL_S="1",
        VIGIL_CPU_SLOTS="2",
        OMP_NUM_THREADS="1",
    )
    log = stack_dir / "up.log"
    with log.open("wb") as out:
        proc = subprocess.Popen(
            [str(Path(sys.executable).parent / "vigil"), "up"], env=env, stdout=out, stderr=subprocess.STDOUT
        )
    try:
        yield UpProcess(proc, f"http://127.0.0.1:{port}", data, log)
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)


def _endpoints(up: UpProcess) -> dict[str, str] | None:
    """The token and NATS URL once `vigil up` has written them (None before)."""
    assert up.proc.poll() is None, up.log.read_text()[-3000:]
    token_file, endpoints = up.data_dir / "api_token", up.data_dir / "endpoints.json"
    if not (token_file.exists() and endpoints.exists()):
        return None
    # the NATS URL with the admin credential that `vigil up` generated (the endpoints file has none)
    own = Settings.load(data_dir=up.data_dir).model_copy(update={"nats_url": None, "database_url": None})
    settings = resolve_urls(own)
    return {"token": token_file.read_text().strip(), "nats": settings.nats_url or ""}


@pytest.fixture(scope="module")
async def stack(up_process: UpProcess) -> Stack:
    """The stack once its gateway answers and its worker is alive."""

    async def ready() -> dict[str, str] | None:
        found = _endpoints(up_process)
        if found is None:
            return None
        headers = {"Authorization": f"Bearer {found['token']}"}
        with contextlib.suppress(httpx.HTTPError):
            async with httpx.AsyncClient(base_url=up_process.base_url, headers=headers) as http:
                if any(n["alive"] for n in (await http.get("/api/v1/nodes")).json()["items"]):
                    return found
        return None

    found = await eventually(ready, timeout=120, what="vigil up ready with a live worker")
    return Stack(up_process.base_url, found["token"], found["nats"], up_process.data_dir)


@pytest.fixture(scope="module")
def chromium() -> str:
    assert Path(CHROMIUM).exists(), (
        f"{CHROMIUM} is missing: run scripts/install.sh (apt-get install chromium)"
    )
    return CHROMIUM


@pytest.fixture(scope="module")
async def browser(stack_dir: Path, chromium: str) -> AsyncIterator[object]:
    """One Chromium context (a fresh profile) for the module: a login carries over between tests."""
    from playwright.async_api import async_playwright

    async with async_playwright() as p:
        context = await p.chromium.launch_persistent_context(
            str(stack_dir / "chromium-profile"),
            executable_path=chromium,
            headless=True,
            args=CHROMIUM_ARGS,
            viewport={"width": 1400, "height": 1000},
            # Playwright compiles a wait_for_function predicate in the page with eval, which the
            # console's Content-Security-Policy forbids; the headers and the pages' lack of inline
            # script are tested in tests/integration/scheduler/test_console_security.py.
            bypass_csp=True,
        )
        context.set_default_timeout(30_000)
        try:
            yield context
        finally:
            await context.close()
