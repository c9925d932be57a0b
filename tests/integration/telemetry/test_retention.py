"""Bounded step storage against a real Postgres: steps land in time partitions created ahead, the
per-step aggregates across ranks outlive them, and retention drops a whole old partition."""

from __future__ import annotations

import asyncio
from datetime import UTC, datetime, timedelta

import pytest

from tests.helpers import eventually, launch_on, service, step_completed
from vigil.events import StepCompleted
from vigil_common import readmodel, subjects
from vigil_common.settings import Settings
from vigil_telemetry import partitions, store
from vigil_telemetry.main import run

pytestmark = pytest.mark.integration

# A period long past, so no other test's steps (stored in the default partition) share it.
OLD = datetime(2001, 3, 5, 10, 0, tzinfo=UTC)


def step(job: str, k: int, rank: int, at: datetime, loss: float = 2.0) -> StepCompleted:
    return step_completed(
        job, k, rank, loss=loss, node="n1", tokens=512, step_time_s=0.1 * (rank + 1), data_time_s=0.01,
        forward_time_s=0.03, backward_time_s=0.04, optimizer_time_s=0.01, occurred_at=at, data_position=0,
    )  # fmt: skip


async def write(pool, events: list[StepCompleted]) -> None:  # type: ignore[no-untyped-def]
    async with pool.acquire() as conn, conn.transaction():
        await store.write_steps(conn, events)


def test_periods_are_aligned_and_named() -> None:
    start = partitions.period_start(OLD, 24)
    assert start == datetime(2001, 3, 5, tzinfo=UTC)
    assert partitions.partition_name(start) == "telemetry_steps_p20010305_00"
    periods = partitions.wanted_periods(OLD, 6, ahead=2)
    assert [p[0].hour for p in periods] == [0, 6, 12, 18]  # the previous, current and two ahead
    assert partitions.expired({"a": (OLD, OLD + timedelta(hours=1)), "b": (OLD, OLD + timedelta(days=9))},
                              OLD + timedelta(days=1)) == ["a"]  # fmt: skip


async def test_retention_drops_an_old_partition_and_aggregates_remain(pool, job_id) -> None:
    async with pool.acquire() as conn:
        created = await partitions.ensure_partitions(conn, OLD, 24)
    name = partitions.partition_name(partitions.period_start(OLD, 24))
    assert name in created
    # two ranks, three steps; rank 0 re-runs step 1 after a rollback (its newer event replaces the first)
    events = [step(job_id, k, r, OLD + timedelta(seconds=k)) for k in range(3) for r in range(2)]
    await write(pool, events)
    await write(pool, [step(job_id, 1, 0, OLD + timedelta(seconds=60), loss=1.0)])
    await write(pool, events[:2])  # a redelivered batch adds nothing
    in_partition = await pool.fetchval(f"SELECT count(*) FROM {name} WHERE job_id = $1", job_id)
    assert in_partition == 7
    agg = await readmodel.steps(pool, job_id, aggregate=True)
    assert [(i["step"], i["ranks"]) for i in agg["items"]] == [(0, 2), (1, 2), (2, 2)]
    assert agg["items"][1]["loss"] == pytest.approx(1.5)  # mean of rank 0's re-run (1.0) and rank 1 (2.0)
    assert agg["items"][2]["step_time_s"] == pytest.approx(0.2)  # the slowest rank

    # Within the window nothing goes; past it the partition is dropped whole, not row by row.
    async with pool.acquire() as conn:
        dropped, _ = await partitions.drop_expired(conn, OLD + timedelta(days=3), timedelta(days=7))
        assert name not in dropped
        dropped, deleted = await partitions.drop_expired(conn, OLD + timedelta(days=9), timedelta(days=7))
    assert name in dropped and deleted == 0
    assert await pool.fetchval("SELECT to_regclass($1)", name) is None
    assert await pool.fetchval("SELECT count(*) FROM telemetry_steps WHERE job_id = $1", job_id) == 0
    # the job's curve stays readable: aggregated, and as the first page of a per-rank read
    assert await readmodel.steps(pool, job_id, aggregate=True) == agg
    fallback = await readmodel.steps(pool, job_id)
    assert [(i["step"], i["rank"]) for i in fallback["items"]] == [(0, None), (1, None), (2, None)]
    assert (await readmodel.steps(pool, job_id, rank=0))["items"] == []


async def test_replicas_writing_ranks_of_one_step_at_once_aggregate_all_of_them(pool, job_id) -> None:
    """Two writers (as two telemetry replicas) commit ranks of the same steps concurrently."""
    at = datetime.now(UTC)
    halves = [
        [step(job_id, k, r, at) for k in range(20) for r in ranks] for ranks in ((0, 1, 2, 3), (4, 5, 6, 7))
    ]
    await asyncio.gather(*(write(pool, h) for h in halves))
    agg = await readmodel.steps(pool, job_id, aggregate=True)
    assert [i["ranks"] for i in agg["items"]] == [8] * 20


async def test_maintenance_creates_partitions_ahead_of_now(pool, tmp_path) -> None:
    s = Settings.load(data_dir=tmp_path, step_partition_hours=24, step_retention_days=3650)
    now = datetime.now(UTC)
    await partitions.maintain_once(pool, s, now)
    async with pool.acquire() as conn:
        have = await partitions.partition_bounds(conn)
    for start, _ in partitions.wanted_periods(now, 24):
        name = partitions.partition_name(start)
        # a period whose rows were already in the default partition keeps them there
        assert name in have or await pool.fetchval(
            "SELECT count(*) FROM telemetry_steps_default WHERE occurred_at >= $1 AND occurred_at < $2",
            start,
            start + timedelta(hours=24),
        )


async def test_two_replicas_started_together_share_the_step_consumer(
    bus, pool, migrated, nats_url, job_id, tmp_path
) -> None:
    s = Settings.load(nats_url=nats_url, database_url=migrated, data_dir=tmp_path, metrics_port=0)
    await launch_on(bus, job_id, {r: "n1" for r in range(4)})
    async with service(run, s) as (a, _), service(run, s) as (b, _):
        events = [step(job_id, k, r, datetime.now(UTC)) for k in range(10) for r in range(4)]
        await asyncio.gather(*(bus.publish(subjects.step(job_id, e.node), e) for e in events))

        async def stored() -> bool:
            n = await pool.fetchval("SELECT count(*) FROM telemetry_steps WHERE job_id = $1", job_id)
            return n == 40

        await eventually(stored, what="40 steps stored by the replicas")
        assert not a.done() and not b.done()
