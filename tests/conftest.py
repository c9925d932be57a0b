"""Session fixtures with real servers: NATS (JetStream) and Postgres.

Order of preference: the user's VIGIL_NATS_URL / VIGIL_DATABASE_URL; testcontainers
when a Docker engine answers and can start the container; otherwise the embedded servers Vigil itself
uses. An engine that answers but cannot pull the image (or testcontainers' own ryuk), as on an
air-gapped cluster or beside the compose test's dockerd, is no engine here.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import subprocess
import tempfile
import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import asyncpg
import pytest

from vigil_common.bus import Bus
from vigil_common.credentials import APP_ROLE
from vigil_common.db import create_pool, migrate
from vigil_common.embedded import EmbeddedNats, EmbeddedPostgres

# Workers here keep no warm ranks unless a test asks for them (tests/integration/worker/test_warm.py): each
# is a process importing torch, DeepSpeed and inductor (4-8 s of CPU), and the suite starts dozens of
# workers on two cores, where that load delayed heartbeats past a node's loss.
os.environ.setdefault("VIGIL_WARM_RANKS", "0")

SHARED_TEMP = Path(tempfile.gettempdir()) / "vigil-pytest"
KEEP_TEMP = 3  # the newest sessions' folders kept for a look after the run, as pytest keeps its own


def pytest_configure(config: pytest.Config) -> None:
    """As root, a worker runs each job as a user of its own, which must pass through the folders above
    the data dir (the worker gives them o+x). pytest's own base, /tmp/pytest-of-root, is made 0700 again
    by every pytest session that starts meanwhile (another checkout's), which would cut running ranks off
    their run folders: this session's base is a folder of its own under /tmp/vigil-pytest instead."""
    if config.option.basetemp is not None or os.geteuid() != 0:
        return
    SHARED_TEMP.mkdir(exist_ok=True)
    os.chmod(SHARED_TEMP, 0o711)
    old = sorted(SHARED_TEMP.iterdir(), key=lambda p: p.stat().st_mtime)
    for stale in old[: max(0, len(old) - KEEP_TEMP)]:
        if not Path(f"/proc/{stale.name.split('-')[0]}").exists():  # its session has ended
            shutil.rmtree(stale, ignore_errors=True)
    config.option.basetemp = str(SHARED_TEMP / f"{os.getpid()}-{uuid.uuid4().hex[:6]}")


def docker_available() -> bool:
    if not shutil.which("docker"):
        return False
    try:
        return subprocess.run(["docker", "info"], capture_output=True, timeout=10).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


@pytest.fixture(scope="session")
def servers_dir() -> Iterator[Path]:
    path = Path(tempfile.mkdtemp(prefix="vigil-test-"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


def in_docker(
    stack: contextlib.ExitStack, start: Callable[[], contextlib.AbstractContextManager[str]]
) -> str | None:
    """The URL of the server `start()` runs in a container, kept until `stack` closes; None where no Docker
    engine answers, or where the one that does cannot start it: an image (the server's, or testcontainers'
    ryuk) it cannot pull, as where no registry can be reached."""
    if not docker_available():
        return None
    from docker.errors import DockerException

    try:
        return stack.enter_context(start())
    except DockerException as e:
        print(f"conftest: Docker answers but cannot start the container ({str(e)[:300]}): embedded servers")
        return None


@contextlib.contextmanager
def _nats_container() -> Iterator[str]:
    from testcontainers.core.container import DockerContainer
    from testcontainers.core.waiting_utils import wait_for_logs

    with DockerContainer("nats:2.11").with_command("-js").with_exposed_ports(4222) as c:
        wait_for_logs(c, "Server is ready")
        yield f"nats://{c.get_container_host_ip()}:{c.get_exposed_port(4222)}"


@contextlib.contextmanager
def _postgres_container() -> Iterator[str]:
    from testcontainers.postgres import PostgresContainer

    with PostgresContainer("postgres:17", driver=None) as pg:
        yield pg.get_connection_url()


@pytest.fixture(scope="session")
def nats_url(servers_dir: Path) -> Iterator[str]:
    with contextlib.ExitStack() as stack:
        if url := os.environ.get("VIGIL_NATS_URL") or in_docker(stack, _nats_container):
            yield url
        else:
            with EmbeddedNats(servers_dir / "nats", durable=False) as server:  # thrown away at the end
                yield server.url


async def _allow_createdb(admin_url: str) -> None:
    conn = await asyncpg.connect(admin_url)
    try:
        await conn.execute(f"ALTER ROLE {APP_ROLE} CREATEDB")
    finally:
        await conn.close()


@pytest.fixture(scope="session")
def database_url(servers_dir: Path) -> Iterator[str]:
    with contextlib.ExitStack() as stack:
        if url := os.environ.get("VIGIL_DATABASE_URL") or in_docker(stack, _postgres_container):
            yield url
        else:
            with EmbeddedPostgres(servers_dir / "postgres", durable=False) as server:  # thrown away after
                # The services' role, as `vigil up` makes it (no superuser), and one test-only right: tests
                # make a fresh database per scheduler (tests/integration/security/test_postgres_role.py
                # checks the role as `vigil up` leaves it).
                with ThreadPoolExecutor(1) as one:  # whether or not an event loop runs in this thread
                    one.submit(asyncio.run, _allow_createdb(server.admin_url)).result()
                yield server.url


@pytest.fixture
async def bus(nats_url: str) -> AsyncIterator[Bus]:
    b = await Bus.connect(nats_url, name=f"test-{uuid.uuid4().hex[:6]}")
    await b.ensure_streams()
    yield b
    await b.close()


@pytest.fixture(scope="session")
async def migrated(database_url: str) -> str:
    pool = await create_pool(database_url)
    try:
        await migrate(pool)
    finally:
        await pool.close()
    return database_url


@pytest.fixture
async def pool(migrated: str) -> AsyncIterator[object]:
    p = await create_pool(migrated, max_size=5)
    yield p
    await p.close()


@pytest.fixture
def server_dir() -> Iterator[Path]:
    """A fresh folder for a test's own embedded servers, outside pytest's 0700 temp tree (the
    embedded Postgres runs as another user, which must traverse every folder above its data)."""
    path = Path(tempfile.mkdtemp(prefix="vigil-srv-"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def job_id() -> str:
    """A fresh job id, so tests sharing the servers never see each other's messages."""
    return "j-" + uuid.uuid4().hex[:12]


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Skip `gpu` tests where no NVIDIA GPU is present."""
    try:
        import torch

        has_gpu = torch.cuda.is_available()
    except Exception:
        has_gpu = False
    if has_gpu:
        return
    skip = pytest.mark.skip(reason="no NVIDIA GPU on this machine")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
