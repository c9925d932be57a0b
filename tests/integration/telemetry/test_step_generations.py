"""A step run twice has two histories (issue 32, migration 0017) against a real Postgres: the steps
stored before it get their generation from the in-place rollbacks stored before them, the aggregate
keeps each step's last run, and a late event of an abandoned run changes nothing."""

from __future__ import annotations

import json
import math
import uuid
from collections.abc import AsyncIterator
from datetime import UTC, datetime, timedelta
from urllib.parse import urlsplit, urlunsplit

import asyncpg
import pytest

from tests.helpers import step_completed
from vigil_common import readmodel
from vigil_common.db import create_pool, load_migrations, migrate
from vigil_telemetry import store

pytestmark = pytest.mark.integration

T0 = datetime(2026, 3, 1, 12, 0, tzinfo=UTC)
JOB, OTHER = "j-generations", "j-no-rollback"
# What a step row held before migration 0017 (its columns, without `generation`).
OLD_COLUMNS = (
    "event_id, job_id, attempt, step, rank, node, loss, grad_norm, lr, tokens, tokens_per_s, data_time_s, "
    "forward_time_s, backward_time_s, comm_time_s, optimizer_time_s, step_time_s, skipped, data_position, "
    "occurred_at"
)


@pytest.fixture
async def before_0017(database_url: str) -> AsyncIterator[asyncpg.Pool]:
    """A fresh database migrated up to 0016."""
    name = "gen_" + uuid.uuid4().hex[:12]
    conn = await asyncpg.connect(database_url)
    try:
        await conn.execute(f'CREATE DATABASE "{name}"')
    finally:
        await conn.close()
    pool = await create_pool(urlunsplit(urlsplit(database_url)._replace(path="/" + name)), max_size=3)
    try:
        await migrate(pool, [m for m in load_migrations() if m.version < 17])
        yield pool
    finally:
        await pool.close()


async def old_steps(pool: asyncpg.Pool, rows: list[tuple[str, int, int, int, float, int]]) -> None:
    """(job, attempt, step, rank, loss, seconds after T0) rows, inserted as a pre-0017 writer did."""
    await pool.executemany(
        f"""INSERT INTO telemetry_steps ({OLD_COLUMNS})
            VALUES ($1, $2, $3, $4, $5, 'n1', $6, 1.0, 1e-3, 512, 1000.0, 0.01, 0.03, 0.04, 0.01, 0.01, 0.1,
                    false, $4, $7)""",
        [(uuid.uuid4().hex, j, a, s, r, loss, T0 + timedelta(seconds=t)) for j, a, s, r, loss, t in rows],
    )


async def old_rollback(pool: asyncpg.Pool, attempt: int, from_step: int, to_step: int, at_s: int) -> None:
    payload = {
        "from_step": from_step,
        "to_step": to_step,
        "checkpoint": f"/c/step_{to_step}",
        "duration_s": 1,
    }
    await pool.execute(
        """INSERT INTO telemetry_status_events (event_id, job_id, attempt, type, occurred_at, payload)
           VALUES ($1, $2, $3, 'rollback.completed', $4, $5::jsonb)""",
        uuid.uuid4().hex,
        JOB,
        attempt,
        T0 + timedelta(seconds=at_s),
        json.dumps(payload),
    )


def loss(step: int, generation: int) -> float:
    return 10.0 * generation + step


async def test_old_rows_get_the_generation_of_the_rollbacks_before_them(before_0017: asyncpg.Pool) -> None:
    pool = before_0017
    # Attempt 1 of JOB: steps 0..5 on two ranks (rank 1's step 3 a NaN); rolled back in place from 5 to
    # 2, steps 2..6 again; rolled back from 6 to 4, steps 4..6 a third time. Attempt 2: steps 0..1 (a
    # relaunch, no in-place rollback of its own). OTHER: no rollback at all.
    first = [
        (JOB, 1, s, r, math.nan if (s, r) == (3, 1) else loss(s, 0), s) for s in range(6) for r in (0, 1)
    ]
    await old_steps(pool, first)
    await old_rollback(pool, 1, from_step=5, to_step=2, at_s=10)
    await old_steps(pool, [(JOB, 1, s, r, loss(s, 1), 11 + s) for s in range(2, 7) for r in (0, 1)])
    await old_rollback(pool, 1, from_step=6, to_step=4, at_s=20)
    await old_steps(pool, [(JOB, 1, s, r, loss(s, 2), 21 + s) for s in range(4, 7) for r in (0, 1)])
    await old_steps(pool, [(JOB, 2, s, r, loss(s, 0), 40 + s) for s in range(2) for r in (0, 1)])
    await old_steps(pool, [(OTHER, 1, s, 0, loss(s, 0), 11 + s) for s in range(3)])

    assert await migrate(pool, [m for m in load_migrations() if m.version <= 17]) == [17]

    got = await pool.fetch(
        "SELECT job_id, attempt, step, rank, generation, loss FROM telemetry_steps ORDER BY occurred_at, rank"
    )
    assert len(got) == 12 + 10 + 6 + 4 + 3
    for row in got:
        expected = 0 if row["job_id"] == OTHER or row["attempt"] == 2 else None
        if expected is None:  # the loss says which run wrote it
            expected = 0 if math.isnan(row["loss"]) else int(row["loss"] // 10)
        assert row["generation"] == expected, dict(row)

    # the aggregate of each step is its last run's, NaN of the abandoned run and all
    agg = await readmodel.steps(pool, JOB, attempt=1, aggregate=True, limit=100)
    assert [(a["step"], a["generation"], a["loss"], a["ranks"]) for a in agg["items"]] == [
        (0, 0, 0.0, 2),
        (1, 0, 1.0, 2),
        (2, 1, 12.0, 2),
        (3, 1, 13.0, 2),
        (4, 2, 24.0, 2),
        (5, 2, 25.0, 2),
        (6, 2, 26.0, 2),
    ]
    # per rank: both (all three) runs, ordered by generation within a step
    page = await readmodel.steps(pool, JOB, rank=1, attempt=1, limit=100)
    assert [(i["step"], i["generation"]) for i in page["items"] if i["step"] in (3, 4)] == [
        (3, 0),
        (3, 1),
        (4, 0),
        (4, 1),
        (4, 2),
    ]

    # after the migration: an abandoned run's event that comes late leaves the aggregate as it is...
    late = step_completed(
        JOB, 5, loss=99.0, node="n1", tokens=512, generation=1, occurred_at=T0 + timedelta(seconds=30)
    )
    async with pool.acquire() as conn, conn.transaction():
        await store.write_steps(conn, [late])
    agg = await readmodel.steps(pool, JOB, attempt=1, aggregate=True, limit=100)
    assert {a["step"]: (a["generation"], a["loss"]) for a in agg["items"]}[5] == (2, 25.0)
    # ...and a step's fourth run replaces it, once its first rank reports it
    rerun = late.model_copy(update={"event_id": uuid.uuid4().hex, "loss": 35.0, "generation": 3})
    async with pool.acquire() as conn, conn.transaction():
        await store.write_steps(conn, [rerun])
    agg = await readmodel.steps(pool, JOB, attempt=1, aggregate=True, limit=100)
    assert {a["step"]: (a["generation"], a["loss"], a["ranks"]) for a in agg["items"]}[5] == (3, 35.0, 1)
