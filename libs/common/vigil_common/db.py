"""Postgres: an asyncpg pool and numbered, forward-only SQL migrations.

Migrations are `migrations/NNNN_name.sql`, applied once each, in order, at start. An
advisory lock makes concurrent starters safe: the second waits, then finds nothing to do.
A migration edited after it was applied is an error (its checksum is recorded).
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import re
from dataclasses import dataclass
from pathlib import Path

import asyncpg

from vigil.errors import ConfigError, RetryableError
from vigil_common.redact import redact_text, redact_url

log = logging.getLogger(__name__)

MIGRATIONS_DIR = Path(__file__).parent / "migrations"
_LOCK_KEY = 0x76696769  # "vigi": the advisory lock every migrator takes
_NAME = re.compile(r"^(\d{4})_([a-z0-9_]+)\.sql$")


@dataclass(frozen=True)
class Migration:
    version: int
    name: str
    sql: str

    @property
    def checksum(self) -> str:
        return hashlib.sha256(self.sql.encode()).hexdigest()


def load_migrations(directory: Path = MIGRATIONS_DIR) -> list[Migration]:
    out = []
    for path in sorted(directory.glob("*.sql")):
        m = _NAME.match(path.name)
        if not m:
            raise ConfigError(f"migration file {path.name!r} must be named NNNN_name.sql")
        out.append(Migration(int(m.group(1)), m.group(2), path.read_text()))
    versions = [m.version for m in out]
    if len(set(versions)) != len(versions):
        raise ConfigError(f"two migrations share a number in {directory}: {versions}")
    return out


async def create_pool(
    url: str, *, min_size: int = 1, max_size: int = 10, timeout_s: float = 30.0
) -> asyncpg.Pool:
    """A connection pool, retrying while the server starts (up to `timeout_s`)."""
    deadline = asyncio.get_running_loop().time() + timeout_s
    delay = 0.1
    while True:
        try:
            return await asyncpg.create_pool(url, min_size=min_size, max_size=max_size, command_timeout=60)
        except (OSError, asyncpg.CannotConnectNowError, asyncpg.TooManyConnectionsError) as exc:
            if asyncio.get_running_loop().time() + delay > deadline:
                raise RetryableError(
                    f"cannot reach Postgres at {redact_url(url)}: {redact_text(str(exc))}"
                ) from exc
            await asyncio.sleep(delay)  # back-off while the server starts
            delay = min(delay * 2, 2.0)


async def migrate(pool: asyncpg.Pool, migrations: list[Migration] | None = None) -> list[int]:
    """Apply pending migrations in order; returns the versions applied by this call."""
    migrations = load_migrations() if migrations is None else migrations
    applied_now: list[int] = []
    async with pool.acquire() as conn:
        await conn.execute("SELECT pg_advisory_lock($1)", _LOCK_KEY)
        try:
            await conn.execute(
                """CREATE TABLE IF NOT EXISTS schema_migrations (
                       version integer PRIMARY KEY,
                       name text NOT NULL,
                       checksum text NOT NULL,
                       applied_at timestamptz NOT NULL DEFAULT now())"""
            )
            done = {
                r["version"]: r["checksum"]
                for r in await conn.fetch("SELECT version, checksum FROM schema_migrations")
            }
            for m in migrations:
                if m.version in done:
                    if done[m.version] != m.checksum:
                        raise ConfigError(
                            f"migration {m.version:04d}_{m.name} changed after it was applied; "
                            "migrations are forward-only: add a new one instead"
                        )
                    continue
                async with conn.transaction():
                    await conn.execute(m.sql)
                    await conn.execute(
                        "INSERT INTO schema_migrations (version, name, checksum) VALUES ($1, $2, $3)",
                        m.version,
                        m.name,
                        m.checksum,
                    )
                log.info("applied migration %04d_%s", m.version, m.name)
                applied_now.append(m.version)
        finally:
            await conn.execute("SELECT pg_advisory_unlock($1)", _LOCK_KEY)
    return applied_now
