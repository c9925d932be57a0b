"""The embedded dev servers: start, keep data across a restart, stop cleanly."""

from __future__ import annotations

import asyncio
import socket
from pathlib import Path

import asyncpg
import pytest

from vigil import events as ev
from vigil_common import subjects
from vigil_common.bus import Bus
from vigil_common.embedded import EmbeddedNats, EmbeddedPostgres

pytestmark = pytest.mark.integration


def listening(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


def test_nats_keeps_stream_data_across_a_restart(server_dir: Path):
    async def publish(url: str) -> None:
        bus = await Bus.connect(url, "t")
        await bus.ensure_streams()
        await bus.publish(subjects.cmd("j-keep"), ev.CancelJob(job_id="j-keep", attempt=1))
        await bus.close()

    async def count(url: str) -> int:
        bus = await Bus.connect(url, "t")
        info = await bus.js.stream_info(subjects.COMMANDS.name)
        await bus.close()
        return info.state.messages

    server = EmbeddedNats(server_dir)
    server.start()
    asyncio.run(publish(server.url))
    port = server.port
    server.stop()
    assert server.proc.returncode is not None and not listening(port)
    assert "sync_interval: always" in (server_dir / "nats.conf").read_text()

    again = EmbeddedNats(server_dir)
    again.start()
    try:
        assert asyncio.run(count(again.url)) == 1
    finally:
        again.stop()


def test_postgres_keeps_data_across_a_restart(server_dir: Path):
    async def write(url: str) -> None:
        conn = await asyncpg.connect(url)
        await conn.execute("CREATE TABLE kept (x int); INSERT INTO kept VALUES (42)")
        await conn.close()

    async def read(url: str) -> int:
        conn = await asyncpg.connect(url)
        value = await conn.fetchval("SELECT x FROM kept")
        assert await conn.fetchval("SHOW fsync") == "on"  # `vigil up`'s server: durable
        await conn.close()
        return value

    server = EmbeddedPostgres(server_dir)
    server.start()
    asyncio.run(write(server.url))
    port = server.port
    server.stop()
    assert not listening(port) and not (server_dir / "pgdata" / "postmaster.pid").exists()

    again = EmbeddedPostgres(server_dir)
    again.start()
    try:
        assert asyncio.run(read(again.url)) == 42
    finally:
        again.stop()


def test_servers_for_throwaway_data_skip_the_flushes(
    servers_dir: Path, nats_url: str, database_url: str
) -> None:
    """Tests' servers (`durable=False`): Postgres with no fsync, no full-page writes and commits not
    waited on; NATS syncing its store on its own interval. The session's servers are such; `vigil up`'s
    are not (the tests above)."""
    if not (servers_dir / "nats" / "nats.conf").exists() or not (servers_dir / "postgres").exists():
        pytest.skip("the session's servers are not the embedded ones (VIGIL_NATS_URL, or containers)")
    assert "sync_interval" not in (servers_dir / "nats" / "nats.conf").read_text()

    async def flushes(url: str) -> list[str]:
        conn = await asyncpg.connect(url)
        try:
            return [
                await conn.fetchval(f"SHOW {name}")
                for name in ("fsync", "full_page_writes", "synchronous_commit")
            ]
        finally:
            await conn.close()

    assert asyncio.run(flushes(database_url)) == ["off", "off", "off"]


@pytest.fixture
def small_disk(tmp_path: Path):
    """A 64 MiB filesystem: far less free than the streams declare (25 GiB)."""
    import os
    import subprocess

    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    mount = tmp_path / "small"
    mount.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64M", "tmpfs", str(mount)], check=True)
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=False)


def test_nats_makes_every_stream_on_a_disk_with_less_free_than_they_declare(small_disk: Path):
    """JetStream reserves each stream's max_bytes; the server's own limit would be a share of the free
    disk, and a CI disk that had filled refused VIGIL_JOBS ("insufficient storage resources")."""

    async def make(url: str) -> list[str]:
        bus = await Bus.connect(url, "t")
        try:
            await bus.ensure_streams()
            return sorted([info.config.name async for info in _streams(bus)])
        finally:
            await bus.close()

    async def _streams(bus: Bus):
        for spec in subjects.STREAMS:
            yield await bus.js.stream_info(spec.name)

    with EmbeddedNats(small_disk / "nats") as server:
        names = asyncio.run(make(server.url))
    assert names == sorted(spec.name for spec in subjects.STREAMS)
