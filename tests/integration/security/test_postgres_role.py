"""The application's Postgres role owns its schema and nothing more, and the embedded server does not run
with root's group (the probe ran `COPY ... TO PROGRAM` as the server's user, in root's group)."""

from __future__ import annotations

import asyncio
import os
from collections.abc import Iterator
from pathlib import Path

import asyncpg
import pytest

from vigil_common.credentials import APP_DATABASE, APP_ROLE
from vigil_common.db import create_pool, migrate
from vigil_common.embedded import EmbeddedPostgres

pytestmark = [pytest.mark.integration, pytest.mark.security]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EmbeddedPostgres]:
    """As `vigil up` starts it: a superuser password and the application's own."""
    pg = EmbeddedPostgres(
        tmp_path_factory.mktemp("pg-role"), password="su-" + "s" * 24, app_password="a" * 24
    )
    with pg:
        yield pg


async def test_the_application_role_migrates_and_owns_its_tables_but_is_no_superuser(
    server: EmbeddedPostgres,
) -> None:
    assert f"{APP_ROLE}:" in server.url and server.url.endswith(f"/{APP_DATABASE}")
    pool = await create_pool(server.url, max_size=2)
    try:
        await migrate(pool)
        async with pool.acquire() as conn:
            assert await conn.fetchval("SELECT current_user") == APP_ROLE
            assert await conn.fetchval("SELECT rolsuper FROM pg_roles WHERE rolname = current_user") is False
            owners = await conn.fetch("SELECT DISTINCT tableowner FROM pg_tables WHERE schemaname = 'public'")
            assert [r["tableowner"] for r in owners] == [APP_ROLE]
            for role in ("pg_execute_server_program", "pg_read_server_files", "pg_write_server_files"):
                assert await conn.fetchval("SELECT pg_has_role(current_user, $1, 'MEMBER')", role) is False
            with pytest.raises(asyncpg.InsufficientPrivilegeError):
                await conn.execute("COPY (SELECT 1) TO PROGRAM 'id'")
            with pytest.raises(asyncpg.InsufficientPrivilegeError):
                await conn.execute("COPY (SELECT 1) TO '/tmp/vigil-probe'")
            with pytest.raises(asyncpg.InsufficientPrivilegeError):
                await conn.fetchval("SELECT pg_read_file('/etc/passwd')")
            with pytest.raises(asyncpg.InsufficientPrivilegeError):
                await conn.execute("CREATE ROLE intruder SUPERUSER")
    finally:
        await pool.close()
    with pytest.raises(asyncpg.InvalidPasswordError):
        await asyncpg.connect(server.admin_url.replace("su-", "xx-"))


@pytest.mark.skipif(os.geteuid() != 0, reason="the server runs as a user of its own only under root")
def test_the_embedded_server_runs_with_its_own_group_not_roots(server: EmbeddedPostgres) -> None:
    pid = int((server.pgdata / "postmaster.pid").read_text().split()[0])
    status = dict(
        line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines() if ":" in line
    )
    uids, gids, groups = status["Uid"].split(), status["Gid"].split(), status["Groups"].split()
    assert "0" not in uids and "0" not in gids and "0" not in groups, (uids, gids, groups)


def test_tables_of_a_data_dir_from_before_are_copied_into_the_applications_database(tmp_path: Path) -> None:
    """A data dir made when the services used the superuser's `postgres` database keeps its data."""

    async def old_layout(url: str) -> None:
        conn = await asyncpg.connect(url)
        await conn.execute(
            "CREATE TABLE schema_migrations (version int PRIMARY KEY, name text);"
            "INSERT INTO schema_migrations VALUES (1, 'foundation');"
            "CREATE TABLE jobs (id text PRIMARY KEY); INSERT INTO jobs VALUES ('j-old')"
        )
        await conn.close()

    async def rows(url: str) -> tuple[list[str], str]:
        conn = await asyncpg.connect(url)
        try:
            ids = [r["id"] for r in await conn.fetch("SELECT id FROM jobs")]
            owner = await conn.fetchval("SELECT tableowner FROM pg_tables WHERE tablename = 'jobs'")
            await conn.execute("INSERT INTO jobs VALUES ('j-new')")
        finally:
            await conn.close()
        return ids, owner

    with EmbeddedPostgres(tmp_path) as first:
        asyncio.run(old_layout(first.admin_url))
    (tmp_path / "app-database").unlink()  # as a data dir from before the application's role
    with EmbeddedPostgres(tmp_path) as again:
        assert asyncio.run(rows(again.url)) == (["j-old"], APP_ROLE)
