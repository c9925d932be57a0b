"""The quickstart's "Run the stack yourself" commands, as docs/quickstart.md prints them, against a real
`vigil up`: each is run as a reader runs it (the `vigil` command, in the repository, with the data dir and
port `vigil up` was given), and says what the page says it does. The page's other block (install, demo,
test command) is the README's, which CI and tests/integration/demo run; tests/unit/test_docs.py checks
that the page holds no other block.

A command added to that block without a runner here fails this test: say how to run it below."""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import asyncpg
import httpx
import pytest

from tests.doc_commands import QUICKSTART, ROOT, bash_blocks
from tests.helpers import eventually
from vigil_common.embedded import free_port
from vigil_common.endpoints import resolve_urls
from vigil_common.settings import Settings
from vigil_scheduler import inventory

pytestmark = [pytest.mark.integration, pytest.mark.slow]

VIGIL = str(Path(sys.executable).parent / "vigil")
JOB_ID = re.compile(r"\bj-[0-9a-f]{12}\b")


@dataclass
class Up:
    proc: subprocess.Popen[bytes]
    data: Path
    port: int
    log: Path
    env: dict[str, str] = field(default_factory=dict)

    def run(self, command: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
        """`command` as printed (`vigil ...`), run from the repository with this stack's settings."""
        argv = command.split()
        assert argv[0] == "vigil", command
        return subprocess.run(
            [VIGIL, *argv[1:]], cwd=ROOT, env=self.env, capture_output=True, text=True, timeout=timeout
        )

    def start(self, command: str) -> subprocess.Popen[str]:
        """`command` as printed, left running (its output on a pipe)."""
        argv = command.split()
        assert argv[0] == "vigil", command
        return subprocess.Popen(
            [VIGIL, *argv[1:]],
            cwd=ROOT,
            env=self.env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )


def stack_block() -> list[str]:
    """The quickstart's block of commands against a running stack (the one that starts with a submit)."""
    (block,) = [b for b in bash_blocks(QUICKSTART) if b and b[0].startswith("vigil submit")]
    return block


@pytest.fixture
def up(server_dir: Path) -> Iterator[Up]:
    """`vigil up` as a reader starts it, on a data dir and port of its own; Ctrl-C at the end."""
    data, port = server_dir / "data", free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("VIGIL_")}
    env.update(
        VIGIL_DATA_DIR=str(data),
        VIGIL_HTTP_PORT=str(port),
        VIGIL_METRICS_PORT="0",
        VIGIL_WARM_RANKS="0",  # as in the rest of the suite: two cores
        VIGIL_CPU_SLOTS="2",
        OMP_NUM_THREADS="1",
        COLUMNS="200",
    )
    log = server_dir / "up.log"
    with log.open("wb") as out:
        proc = subprocess.Popen([VIGIL, "up"], env=env, stdout=out, stderr=subprocess.STDOUT)
    try:
        yield Up(proc, data, port, log, env)
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)


async def ready(up: Up) -> bool:
    assert up.proc.poll() is None, up.log.read_text()[-3000:]
    token_file = up.data / "api_token"
    if not token_file.exists():
        return False
    headers = {"Authorization": f"Bearer {token_file.read_text().strip()}"}
    try:
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{up.port}", headers=headers) as client:
            nodes = (await client.get("/api/v1/nodes")).json()["items"]
    except (httpx.HTTPError, KeyError, ValueError):
        return False
    return any(n["alive"] and len(n["devices"]) >= 2 for n in nodes)


async def mark_device(up: Up, node: str, index: int) -> None:
    """What a worker's failed known-answer check does: the device marked unhealthy until cleared."""
    own = Settings.load(data_dir=up.data).model_copy(update={"nats_url": None, "database_url": None})
    database_url = resolve_urls(own).database_url
    assert database_url, "no Postgres URL from the vigil up's data dir"
    conn = await asyncpg.connect(database_url)
    try:
        async with conn.transaction():
            assert await inventory.mark_unhealthy(conn, node, index, "quickstart test", source="diagnostic")
    finally:
        await conn.close()


class Lines:
    """A process's output lines, collected as they come (a reader thread), for conditions to poll."""

    def __init__(self, proc: subprocess.Popen[str]) -> None:
        self.lines: list[str] = []
        assert proc.stdout is not None
        stdout = proc.stdout
        self._thread = threading.Thread(
            target=lambda: self.lines.extend(iter(stdout.readline, "")), daemon=True
        )
        self._thread.start()

    def matching(self, *words: str) -> list[str]:
        return [line for line in list(self.lines) if all(w in line for w in words)]


@pytest.mark.timeout(900)
async def test_every_command_of_the_quickstart_runs_as_printed(up: Up) -> None:
    await eventually(lambda: ready(up), timeout=180, what="vigil up's gateway and its worker")
    todo = list(stack_block())
    job = ""

    def take(pattern: str) -> str:
        """The page's next command, which must be the one this step runs (the page's order)."""
        assert todo, f"the quickstart has no more commands; expected {pattern!r}"
        command = todo.pop(0)
        assert re.fullmatch(pattern, command), f"a command this test does not run: {command!r}"
        return command

    r = await asyncio.to_thread(up.run, take(r"vigil submit examples/tiny\.yaml --follow"), 600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "SUCCEEDED" in r.stdout, r.stdout[-3000:]
    job = JOB_ID.search(r.stdout).group(0)  # type: ignore[union-attr]

    r = await asyncio.to_thread(up.run, take(r"vigil jobs"))
    assert r.returncode == 0 and job in r.stdout, r.stdout + r.stderr
    r = await asyncio.to_thread(up.run, take(r"vigil job j-\.\.\.").replace("j-...", job))
    assert r.returncode == 0 and job in r.stdout and "SUCCEEDED" in r.stdout, r.stdout + r.stderr

    r = await asyncio.to_thread(up.run, take(r"vigil nodes"))
    assert r.returncode == 0, r.stdout + r.stderr
    gpus = json.loads((await asyncio.to_thread(up.run, "vigil gpus --json")).stdout)["items"]
    node = gpus[0]["node"]
    assert node in r.stdout
    r = await asyncio.to_thread(up.run, take(r"vigil gpus"))
    assert r.returncode == 0 and node in r.stdout, r.stdout + r.stderr

    await mark_device(up, node, 1)
    r = await asyncio.to_thread(
        up.run, take(r"vigil gpus --clear NODE:DEVICE").replace("NODE:DEVICE", f"{node}:1")
    )
    assert r.returncode == 0 and "mark cleared" in r.stdout, r.stdout + r.stderr
    healthy = json.loads((await asyncio.to_thread(up.run, "vigil gpus --json")).stdout)["items"]
    assert all(g["healthy"] for g in healthy)

    # `vigil watch` runs until Ctrl-C: a second job's events show in it, its cancel too
    watch = up.start(take(r"vigil watch"))
    try:
        lines = Lines(watch)
        r = await asyncio.to_thread(up.run, "vigil submit examples/tiny.yaml")
        assert r.returncode == 0, r.stdout + r.stderr
        second = JOB_ID.search(r.stdout).group(0)  # type: ignore[union-attr]

        async def running() -> list[str]:
            return lines.matching(second, "RUNNING") or lines.matching(second, "CKPT")

        await eventually(running, timeout=300, what=f"vigil watch showing {second} running")
        r = await asyncio.to_thread(up.run, take(r"vigil cancel j-\.\.\.").replace("j-...", second))
        assert r.returncode == 0 and "CANCELLED" in r.stdout, r.stdout + r.stderr

        async def cancelled() -> list[str]:
            return lines.matching(second, "STATE", "CANCELLED")

        await eventually(cancelled, timeout=60, what=f"vigil watch showing {second} CANCELLED")
        watch.send_signal(signal.SIGINT)  # Ctrl-C
        assert await asyncio.to_thread(watch.wait, 30) == 0, "".join(lines.lines)[-3000:]
    finally:
        if watch.poll() is None:
            watch.kill()
    assert not todo, f"commands of the quickstart this test did not run: {todo}"
