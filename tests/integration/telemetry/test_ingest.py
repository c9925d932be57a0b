"""Telemetry against real NATS and Postgres: one row per event, the read model, metrics, a kill mid-stream."""

from __future__ import annotations

import asyncio
import math
import uuid
from datetime import UTC, datetime, timedelta

import httpx
import pytest

from tests.helpers import eventually, launch_on, service, step_completed
from vigil.events import (
    CheckpointSaved,
    GpuSampled,
    IncidentRaised,
    RollbackCompleted,
    StepCompleted,
)
from vigil_common import readmodel, step_columns, subjects
from vigil_common.embedded import free_port
from vigil_common.settings import Settings
from vigil_telemetry.main import run

pytestmark = pytest.mark.integration

T0 = datetime.now(UTC)


def step(job: str, k: int, rank: int, loss: float = 2.0, attempt: int = 1, t: float = 0.0) -> StepCompleted:
    return step_completed(
        job, k, rank, loss=loss, attempt=attempt, tokens=512, tokens_per_s=1000.0 + rank,
        comm_time_s=0.01 * (rank + 1), data_time_s=0.01, forward_time_s=0.03, backward_time_s=0.04,
        optimizer_time_s=0.01, occurred_at=T0 + timedelta(seconds=t or k * 0.1), flops_per_token=2.0e7,
        mfu=0.4 + 0.1 * rank, micro_batch=4, data_position=0,
    )  # fmt: skip


def settings(nats_url: str, database_url: str, tmp_path, metrics_port: int = 0) -> Settings:
    return Settings.load(
        nats_url=nats_url, database_url=database_url, data_dir=tmp_path, metrics_port=metrics_port
    )


async def count(pool, job_id: str) -> int:
    return await pool.fetchval("SELECT count(*) FROM telemetry_steps WHERE job_id = $1", job_id)


async def test_every_kind_of_event_is_stored_once_and_read_back(
    bus, pool, nats_url, migrated, job_id, tmp_path
):
    port = free_port()
    await launch_on(bus, job_id, {0: "n0", 1: "n1"})
    async with service(run, settings(nats_url, migrated, tmp_path, port)):
        for k in range(4):
            for r in range(2):
                await bus.publish(subjects.step(job_id, f"n{r}"), step(job_id, k, r, loss=2.0 - 0.1 * k))
        # a re-run of step 2 after a rollback (a new event), and a NaN step
        await bus.publish(subjects.step(job_id, "n0"), step(job_id, 2, 0, loss=1.5, t=9.0))
        await bus.publish(subjects.step(job_id, "n0"), step(job_id, 4, 0, loss=math.nan))
        for s, t in ((0, 0.0), (2, 0.25), (4, 0.45)):
            await bus.publish(
                subjects.status(job_id, "n0"),
                CheckpointSaved(
                    job_id=job_id,
                    attempt=1,
                    step=s,
                    path=f"/c/{job_id}/step_{s:08d}",
                    bytes=100 + s,
                    manifest_sha256="ab",
                    data_position=s,
                    occurred_at=T0 + timedelta(seconds=t),
                ),
            )
        await bus.publish(
            subjects.status(job_id, "n0"),
            RollbackCompleted(
                job_id=job_id,
                attempt=1,
                from_step=4,
                to_step=2,
                checkpoint=f"/c/{job_id}/step_00000002",
                command_id="c1",
                duration_s=0.2,
                node="n0",
                occurred_at=T0 + timedelta(seconds=1),
            ),
        )
        node = f"n-{uuid.uuid4().hex[:6]}"
        for i in range(3):
            await bus.publish(
                subjects.gpu(node),
                GpuSampled(
                    node=node,
                    index=0,
                    device_kind="gpu",
                    uuid="GPU-0",
                    utilization_pct=50.0 + i,
                    memory_used_bytes=1 << 30,
                    memory_total_bytes=8 << 30,
                    temperature_c=60.0 + i,
                    throttle_reasons=["sw_power_cap"] if i else [],
                    occurred_at=T0 + timedelta(seconds=i),
                ),
            )
        incident = IncidentRaised(
            job_id=job_id,
            attempt=1,
            kind="nan",
            action="rollback",
            step=4,
            rank=0,
            node="n0",
            message="nan",
            evidence={"loss": "NaN", "checkpoint_step": 2},
        )
        await bus.publish(subjects.incident(job_id), incident)

        await eventually(lambda: count(pool, job_id), what="steps")
        await eventually(lambda: _equals(count(pool, job_id), 10), what="10 step rows")
        progress = await eventually(lambda: readmodel.job_progress(pool, [job_id]))
        incidents = await eventually(
            lambda: _items(readmodel.incidents(pool, job_id=job_id)), what="incident"
        )
        samples = await eventually(lambda: _n_items(readmodel.gpu_samples(pool, node=node, index=0), 3))
        checkpoints = await eventually(lambda: _n_items(readmodel.checkpoints(pool, job_id), 3))
        await eventually(lambda: _invalidated(pool, job_id), what="checkpoint 4 superseded")

        # per rank, paged in (attempt, step, rank) order, the re-run after its first run
        page = await readmodel.steps(pool, job_id, rank=0, limit=3)
        assert [i["step"] for i in page["items"]] == [0, 1, 2]
        rest = await readmodel.steps(pool, job_id, rank=0, limit=10, cursor=page["next"])
        assert [i["step"] for i in rest["items"]] == [2, 3, 4] and rest["next"] is None
        assert rest["items"][0]["loss"] == pytest.approx(1.5) and math.isnan(rest["items"][2]["loss"])
        # aggregated: one item per step over each rank's newest event
        agg = await readmodel.steps(pool, job_id, aggregate=True, limit=100)
        by_step = {i["step"]: i for i in agg["items"]}
        assert sorted(by_step) == [0, 1, 2, 3, 4]
        assert by_step[2]["ranks"] == 2 and by_step[2]["loss"] == pytest.approx((1.5 + 1.8) / 2)
        assert by_step[1]["tokens_per_s"] == pytest.approx(2001.0)
        assert by_step[1]["comm_time_s"] == pytest.approx(0.02)
        assert by_step[1]["mfu"] == pytest.approx(0.45) and by_step[1]["flops_per_token"] == 2.0e7
        assert (page["items"][0]["mfu"], page["items"][0]["micro_batch"]) == (pytest.approx(0.4), 4)

        assert progress[job_id]["last_step"] == 2 and progress[job_id]["loss"] == pytest.approx(1.5)
        assert progress[job_id]["mfu"] is not None and progress[job_id]["tokens_per_s"] >= 1000.0
        assert [(i["kind"], i["action"], i["step"]) for i in incidents] == [("nan", "rollback", 4)]
        assert incidents[0]["evidence"] == {"loss": "NaN", "checkpoint_step": 2}
        assert [s["temperature_c"] for s in samples] == [62.0, 61.0, 60.0]  # newest first
        assert samples[0]["throttle_reasons"] == ["sw_power_cap"]
        latest = await readmodel.latest_gpu_samples(pool)
        assert latest[(node, 0)]["temperature_c"] == 62.0
        assert [(c["step"], c["bytes"]) for c in checkpoints] == [(0, 100), (2, 102), (4, 104)]
        # the downsampled buckets kept as the steps came read as the raw rows do, the NaN counted apart
        for width in (4, 8, 16):
            kept = sorted(map(dict, await readmodel.step_buckets(pool, job_id, bucket=width)), key=_key)
            raw = sorted(map(dict, await readmodel._raw_buckets(pool, job_id, width)), key=_key)
            assert len(kept) == len(raw) and all(
                k == pytest.approx(r) for k, r in zip(kept, raw, strict=True)
            )
        assert [(r["rank"], r["loss_bad"]) for r in kept] == [(0, 1), (1, 0)]
        assert kept[0]["loss_hi"] == pytest.approx(2.0) and kept[0]["loss_lo"] == pytest.approx(1.5)

        async with httpx.AsyncClient() as client:
            text = (await client.get(f"http://127.0.0.1:{port}/metrics")).text
        assert f'vigil_step_loss{{job="{job_id}",rank="1"}} 1.7' in text
        assert f'vigil_gpu_temperature_celsius{{index="0",kind="gpu",node="{node}"}} 62' in text
        assert 'vigil_incidents_total{action="rollback",kind="nan"}' in text


def _key(row):
    return row["rank"], row["bucket"]


async def _equals(value, expected):
    return (await value) == expected


async def _items(page_coro):
    return (await page_coro)["items"]


async def _n_items(page_coro, n):
    items = (await page_coro)["items"]
    return items if len(items) == n else None


async def _in_flight(bus) -> bool:
    info = await bus.js.consumer_info(subjects.JOBS.name, "telemetry-steps")
    return info.num_ack_pending > 0


async def _invalidated(pool, job_id):
    return await pool.fetchval(
        "SELECT NOT valid FROM telemetry_checkpoints WHERE job_id = $1 AND step = 4", job_id
    )


async def test_killed_mid_stream_and_restarted_stores_exactly_one_row_per_event(
    bus, pool, nats_url, migrated, job_id, tmp_path
):
    n = 3000
    events = [step(job_id, k // 4, k % 4) for k in range(n)]
    cfg = settings(nats_url, migrated, tmp_path)

    async def publish_all() -> None:
        for i in range(0, n, 100):
            await asyncio.gather(
                *(bus.publish(subjects.step(job_id, e.node), e) for e in events[i : i + 100])
            )

    await launch_on(bus, job_id, {r: f"n{r}" for r in range(4)})
    publisher = asyncio.create_task(publish_all())
    async with service(run, cfg) as (task, _), pool.acquire() as blocker:
        await eventually(lambda: count(pool, job_id), what="the first rows")
        # Hold the next batch in the middle of its write, then kill the service there.
        async with blocker.transaction():
            await blocker.execute("LOCK TABLE telemetry_steps IN SHARE MODE")
            await eventually(lambda: _in_flight(bus), what="a batch in flight")
            task.cancel()  # killed mid-stream: no graceful drain, no acks for what was in flight
            with pytest.raises(asyncio.CancelledError):
                await task
    stored_at_kill = await count(pool, job_id)
    assert await _in_flight(bus)  # the batch being written was not acknowledged
    await publisher
    # the same events again under other message ids: the stream now holds duplicates, as after a
    # publisher's retry outside JetStream's de-duplication window
    for e in events[:200]:
        await bus.js.publish(
            subjects.step(job_id, e.node), e.to_bytes(), headers={"Nats-Msg-Id": "dup-" + e.event_id}
        )
    async with service(run, cfg):
        # the batch in flight at the kill comes back after the consumer's ack wait
        await eventually(lambda: _equals(count(pool, job_id), n), timeout=60, what=f"{n} rows")
    assert stored_at_kill < n
    ids = {
        r["event_id"]
        for r in await pool.fetch("SELECT event_id FROM telemetry_steps WHERE job_id = $1", job_id)
    }
    assert ids == {e.event_id for e in events}
    # every event went into the buckets once (the batch in flight at the kill and the duplicates too)
    for width in step_columns.BUCKET_WIDTHS:
        added = await pool.fetchval(
            "SELECT sum(loss_n + loss_bad) FROM telemetry_step_buckets WHERE job_id = $1 AND width = $2",
            job_id,
            width,
        )
        assert added == n, width


async def test_the_tables_have_the_columns_the_writer_and_reader_name(pool, migrated):
    """step_columns.STEP_COLUMNS and step_columns.BUCKET_COLUMNS against a migrated Postgres, types included."""
    udt = {"text": "text", "int4": "int", "int8": "int8", "float8": "float8", "bool": "bool"}
    udt["timestamptz"] = "timestamptz"

    async def columns(table: str) -> dict[str, str]:
        rows = await pool.fetch(
            """SELECT column_name, udt_name FROM information_schema.columns
               WHERE table_schema = current_schema() AND table_name = $1""",
            table,
        )
        return {r["column_name"]: udt[r["udt_name"]] for r in rows}

    steps = await columns("telemetry_steps")
    assert steps.pop("seq") == "int8"
    assert steps == dict(step_columns.STEP_COLUMNS)
    assert await columns("telemetry_step_buckets") == dict(step_columns.BUCKET_COLUMNS)
