"""One job's bad row never costs another job's steps. The probe's route: the attacker's steps numbered
>= 2^31 overflowed the int4 `step` column, and each failed COPY took its whole batch down with it,
losing 20-57 of the victim's steps.

Steps are int8 now (migration 0014), so those steps are stored. A row Postgres still refuses (here one
that breaks a CHECK this test adds, standing for any row the model lets through and the database does
not) is bisected out of its batch and dead-lettered with the database's reason; every other row of the
batch, the victim's first, is stored."""

from __future__ import annotations

import contextlib
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime, timedelta
from pathlib import Path
from urllib.parse import urlsplit

import asyncpg
import nats.js.errors
import pytest

from tests.helpers import eventually, launch_on, service, step_completed
from tests.integration.scheduler.conftest import fresh_database
from tests.integration.security.test_forged_events import dead_letters
from vigil.events import StepCompleted
from vigil_common import credentials, subjects
from vigil_common.bus import Bus
from vigil_common.embedded import EmbeddedNats
from vigil_common.settings import Settings
from vigil_telemetry import main as telemetry

pytestmark = [pytest.mark.integration, pytest.mark.security]

POISON = 666.0  # a loss the test's CHECK refuses
VICTIM_STEPS = 60


def step(job_id: str, k: int, rank: int, node: str, loss: float = 2.0) -> StepCompleted:
    return step_completed(
        job_id, k, rank, loss=loss, node=node, occurred_at=datetime.now(UTC) - timedelta(seconds=1)
    )


async def stored(pool: asyncpg.Pool, job_id: str) -> list[int]:
    rows = await pool.fetch("SELECT step FROM telemetry_steps WHERE job_id = $1 ORDER BY step", job_id)
    return [r["step"] for r in rows]


async def test_steps_past_2_31_are_stored_and_a_refused_row_costs_no_other_row_of_its_batch(
    server: EmbeddedNats,
    connect: Callable[[str], Awaitable[Bus]],
    admin: Bus,
    database_url: str,
    tmp_path: Path,
    job_id: str,
) -> None:
    url = await fresh_database(database_url)
    pool = await asyncpg.create_pool(url, min_size=1, max_size=2)
    try:
        await pool.execute(f"ALTER TABLE telemetry_steps ADD CONSTRAINT no_poison CHECK (loss <> {POISON})")
        sched, n1, n2 = (
            await connect(credentials.SCHEDULER),
            await connect(credentials.worker_role("n1")),
            await connect(credentials.worker_role("n2")),
        )
        victim, attacker = job_id, f"{job_id}-attacker"
        await launch_on(sched, victim, {0: "n1", 1: "n1"})
        await launch_on(sched, attacker, {0: "n2"})
        big = [2**31, 2**31 + 1, 2**40, 2**63 - 1]
        with contextlib.suppress(nats.js.errors.NotFoundError):  # a fresh consumer: one batch, from now
            await admin.js.delete_consumer(telemetry.STEPS.stream.name, telemetry.STEPS.durable)
        # every step is in the stream before telemetry starts, so they come in one batch, interleaved
        for k in range(VICTIM_STEPS):
            for rank in (0, 1):
                await n1.publish(subjects.step(victim, "n1"), step(victim, k, rank, "n1"))
            if k < len(big):
                await n2.publish(subjects.step(attacker, "n2"), step(attacker, big[k], 0, "n2"))
            if k == VICTIM_STEPS // 2:
                poisoned = step(attacker, 7, 0, "n2", loss=POISON)
                await n2.publish(subjects.step(attacker, "n2"), poisoned)
        settings = Settings.load(
            nats_url=server.url_for(credentials.TELEMETRY),
            database_url=url,
            data_dir=tmp_path,
            metrics_port=0,
        )
        async with (
            admin.watch(subjects.dead_letter(subjects.JOBS.name)) as letters,
            service(telemetry.run, settings),
        ):
            (letter,) = await dead_letters(letters, telemetry.STEPS.durable, 1)
            await eventually(lambda: _has(pool, victim, 2 * VICTIM_STEPS), what="every victim step stored")
            await eventually(lambda: _has(pool, attacker, len(big)), what="the attacker's big steps")
        assert poisoned.event_id in letter.payload and "no_poison" in letter.reason, letter.reason
        assert await stored(pool, victim) == sorted(2 * list(range(VICTIM_STEPS)))
        assert await stored(pool, attacker) == big
        progress = await pool.fetchval(
            "SELECT last_step FROM telemetry_job_progress WHERE job_id = $1", attacker
        )
        assert progress in big
    finally:
        await pool.close()
        name = urlsplit(url).path.lstrip("/")
        conn = await asyncpg.connect(database_url)
        try:
            await conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        finally:
            await conn.close()


async def _has(pool: asyncpg.Pool, job_id: str, n: int) -> bool:
    return len(await stored(pool, job_id)) >= n
