"""The step table's time partitions (migration 0009): created ahead, dropped after the retention window.

Raw per-rank rows live in `telemetry_steps`, partitioned by `occurred_at` into periods of
`VIGIL_STEP_PARTITION_HOURS`; per-step aggregates (`telemetry_step_aggregates`, kept by a trigger)
outlive them. Every telemetry replica runs `maintain`; a transaction-scoped advisory lock lets one
do each round's work at a time.
"""

from __future__ import annotations

import asyncio
import logging
import re
from datetime import UTC, datetime, timedelta

import asyncpg

from vigil_common.service import wait_any
from vigil_common.settings import Settings

log = logging.getLogger(__name__)

TABLE = "telemetry_steps"
DEFAULT_PARTITION = "telemetry_steps_default"
_LOCK_KEY = 0x76737470  # "vstp": partition maintenance
_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)
_BOUND = re.compile(r"FROM \('([^']+)'\) TO \('([^']+)'\)")


def period_start(at: datetime, hours: int) -> datetime:
    """The start of the period holding `at` (periods are aligned to the Unix epoch, in UTC)."""
    period = timedelta(hours=hours)
    return _EPOCH + ((at - _EPOCH) // period) * period


def partition_name(start: datetime) -> str:
    return f"{TABLE}_p{start.astimezone(UTC):%Y%m%d_%H}"


def wanted_periods(now: datetime, hours: int, ahead: int = 2) -> list[tuple[datetime, datetime]]:
    """The previous, current and `ahead` next periods: events a little late or early find a partition."""
    first = period_start(now, hours) - timedelta(hours=hours)
    return [
        (first + i * timedelta(hours=hours), first + (i + 1) * timedelta(hours=hours))
        for i in range(ahead + 2)
    ]


def expired(bounds: dict[str, tuple[datetime, datetime]], cutoff: datetime) -> list[str]:
    """Partitions holding only rows older than `cutoff` (their upper bound is at or before it)."""
    return sorted(name for name, (_, end) in bounds.items() if end <= cutoff)


async def partition_bounds(conn: asyncpg.Connection) -> dict[str, tuple[datetime, datetime]]:
    """Every range partition of the step table with its [start, end) bounds (the default one aside)."""
    rows = await conn.fetch(
        """SELECT c.relname, pg_get_expr(c.relpartbound, c.oid) AS bound
           FROM pg_inherits i JOIN pg_class c ON c.oid = i.inhrelid
           WHERE i.inhparent = $1::regclass""",
        TABLE,
    )
    found = {}
    for row in rows:
        if m := _BOUND.search(row["bound"]):
            found[row["relname"]] = (datetime.fromisoformat(m[1]), datetime.fromisoformat(m[2]))
    return found


async def ensure_partitions(conn: asyncpg.Connection, now: datetime, hours: int, ahead: int = 2) -> list[str]:
    """Create the partitions `wanted_periods` names that do not exist; returns those created.

    A period whose rows already sit in the default partition is left there (creating its partition
    would fail); they are deleted with the default partition's other old rows."""
    have = await partition_bounds(conn)
    created = []
    for start, end in wanted_periods(now, hours, ahead):
        name = partition_name(start)
        if name in have:
            continue
        try:
            async with conn.transaction():
                await conn.execute(
                    f"CREATE TABLE IF NOT EXISTS {name} PARTITION OF {TABLE}"
                    f" FOR VALUES FROM ({_literal(start)}) TO ({_literal(end)})"
                )
        except asyncpg.CheckViolationError:
            log.warning(
                "steps of %s .. %s are in the default partition already: %s not created", start, end, name
            )
            continue
        created.append(name)
    return created


async def drop_expired(
    conn: asyncpg.Connection, now: datetime, retention: timedelta
) -> tuple[list[str], int]:
    """Drop the partitions older than the retention window, and delete the default partition's rows
    older than it. Returns the partitions dropped and the default rows deleted."""
    cutoff = now - retention
    dropped = expired(await partition_bounds(conn), cutoff)
    for name in dropped:
        async with conn.transaction():
            await conn.execute(f"ALTER TABLE {TABLE} DETACH PARTITION {name}")
            await conn.execute(f"DROP TABLE {name}")
    deleted = await conn.execute(f"DELETE FROM {DEFAULT_PARTITION} WHERE occurred_at < $1", cutoff)
    return dropped, int(deleted.split()[-1])


def _literal(at: datetime) -> str:
    """A timestamptz literal (partition bounds take no parameters)."""
    return f"'{at.astimezone(UTC).isoformat()}'"


async def maintain_once(pool: asyncpg.Pool, settings: Settings, now: datetime | None = None) -> None:
    """One round: partitions ahead, expired ones dropped; skipped when another replica holds the lock."""
    now = now or datetime.now(UTC)
    async with pool.acquire() as conn:
        if not await conn.fetchval("SELECT pg_try_advisory_lock($1)", _LOCK_KEY):
            return
        try:
            created = await ensure_partitions(conn, now, settings.step_partition_hours)
            dropped, deleted = await drop_expired(conn, now, timedelta(days=settings.step_retention_days))
        finally:
            await conn.execute("SELECT pg_advisory_unlock($1)", _LOCK_KEY)
    if created or dropped or deleted:
        log.info(
            "step partitions: created %s, dropped %s, %d old default rows deleted", created, dropped, deleted
        )


async def maintain(pool: asyncpg.Pool, settings: Settings, stop: asyncio.Event) -> None:
    """`maintain_once` at start and every few minutes (a period's partition exists a period ahead)."""
    every_s = min(600.0, settings.step_partition_hours * 3600 / 4)
    while not stop.is_set():
        try:
            await maintain_once(pool, settings)
        except (asyncpg.PostgresError, OSError) as exc:
            log.warning("step partition maintenance failed, retrying later: %s", exc)
        await wait_any(stop, timeout_s=every_s)
