"""Migrations against a real Postgres."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import textwrap
import uuid

import asyncpg
import pytest

from vigil.errors import ConfigError
from vigil_common.db import Migration, create_pool, load_migrations, migrate

pytestmark = pytest.mark.integration


async def fresh_database(admin_url: str) -> str:
    name = f"mig_{uuid.uuid4().hex[:10]}"
    conn = await asyncpg.connect(admin_url)
    try:
        await conn.execute(f'CREATE DATABASE "{name}"')
    finally:
        await conn.close()
    return admin_url.rsplit("/", 1)[0] + "/" + name


async def test_migrations_apply_once_and_in_order(database_url: str):
    url = await fresh_database(database_url)
    pool = await create_pool(url)
    try:
        first = await migrate(pool)
        again = await migrate(pool)
        assert first == [m.version for m in load_migrations()] and again == []
        rows = await pool.fetch("SELECT version FROM schema_migrations ORDER BY version")
        assert [r["version"] for r in rows] == first
    finally:
        await pool.close()


async def test_an_edited_migration_is_refused(database_url: str):
    url = await fresh_database(database_url)
    pool = await create_pool(url)
    try:
        await migrate(pool, [Migration(1, "one", "CREATE TABLE t1 (x int);")])
        with pytest.raises(ConfigError, match="forward-only"):
            await migrate(pool, [Migration(1, "one", "CREATE TABLE t1 (x bigint);")])
    finally:
        await pool.close()


def test_two_processes_migrating_at_once_apply_each_migration_once(database_url: str):
    url = asyncio.run(fresh_database(database_url))
    script = textwrap.dedent(f"""
        import asyncio
        from vigil_common.db import create_pool, migrate
        async def main():
            pool = await create_pool({url!r})
            print(await migrate(pool))
            await pool.close()
        asyncio.run(main())
    """)
    procs = [
        subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True) for _ in range(2)
    ]
    outs = [p.communicate(timeout=120)[0].strip() for p in procs]
    assert all(p.returncode == 0 for p in procs)
    applied = [eval(o) for o in outs]  # each prints the list of versions it applied
    everything = [m.version for m in load_migrations()]
    assert sorted(applied, key=len) == [[], everything]


# 6 and 7 were never shipped (no file in the history): the numbers stay skipped, since a deployed database
# records 8 onwards as applied and a renumbered migration would run twice or never
NEVER_SHIPPED = {6, 7}


def consecutive(versions: list[int], skipped: set[int] = NEVER_SHIPPED) -> bool:
    """1, 2, 3, ... in order but the numbers `skipped`: no other gap, no clash, none out of order."""
    last = max(versions, default=0)
    return versions == [v for v in range(1, last + 1) if v not in skipped]


def test_migration_files_are_numbered_without_gaps_or_clashes():
    versions = [m.version for m in load_migrations()]
    assert len(versions) >= 18 and consecutive(versions), versions
    assert not consecutive([1, 2, 9]) and not consecutive([1, 2, 2, 3]) and not consecutive([2, 3])
    assert consecutive([1, 2, 3, 4, 5, 8, 9]) and not consecutive([1, 2, 3, 4, 5, 6, 8])


async def test_the_restart_action_migration_keeps_old_rows_and_reads_old_relaunches_as_restarts(
    database_url: str,
):
    url = await fresh_database(database_url)
    pool = await create_pool(url)
    before = [m for m in load_migrations() if m.version < 20]
    try:
        await migrate(pool, before)
        insert = """INSERT INTO telemetry_incidents (id, job_id, attempt, kind, action, message, evidence,
                        occurred_at) VALUES ($1, 'j-1', 1, $2, 'rollback', 'm', $3::jsonb, now())"""
        await pool.execute(insert, "relaunch", "hang", '{"restart": true, "checkpoint_step": 4}')
        await pool.execute(insert, "in-place", "nan", '{"restart": false, "checkpoint_step": 4}')
        await pool.execute(insert, "oldest", "spike", "{}")  # before the evidence said which
        audit = "INSERT INTO audit_log (action, actor, job_id) VALUES ($1, 'service:guardian', 'j-1')"
        await pool.execute(audit, "rollback")
        with pytest.raises(asyncpg.CheckViolationError):
            await pool.execute(audit, "restart")
        assert await migrate(pool) == [m.version for m in load_migrations() if m.version >= 20]
        rows = await pool.fetch("SELECT id, action FROM telemetry_incidents ORDER BY id")
        assert {r["id"]: r["action"] for r in rows} == {
            "in-place": "rollback",
            "oldest": "rollback",
            "relaunch": "restart",
        }
        await pool.execute(audit, "restart")  # allowed now, and the old row is still there
        actions = await pool.fetch("SELECT action FROM audit_log ORDER BY seq")
        assert [r["action"] for r in actions] == ["rollback", "restart"]
    finally:
        await pool.close()
