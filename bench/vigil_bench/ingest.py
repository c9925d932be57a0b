"""`vigil bench ingest`: step events persisted per second through telemetry, against a raw COPY.

A backlog of N StepCompleted events is published on the steps stream first (not timed). Then
the telemetry service starts and drains it: pull from JetStream, decode, insert batches
idempotently, acknowledge. Telemetry runs as its own process, as in production (`vigil telemetry`:
its heap holds its own objects, not the bench's backlog). Its rate is the rows stored per second
from its first committed batch to the last (startup excluded). The floor, in the same run: asyncpg's
`copy_records_to_table` of the very same rows into a table shaped like telemetry's (same columns
and indexes), which is as fast as Postgres ingests from Python. `value`/`floor` are rates, so
the ratio is telemetry's share of raw COPY speed. Target: ratio >= 0.5.

A second floor shows what Vigil's own code costs: a bare nats-py JetStream push consumer of the
same backlog, shaped like telemetry's (`json.loads`, no pydantic, no dead-lettering, no traces, no
progress table), feeding the same COPY in batches of the same size and acknowledging each message
after its batch commits.
`ratio_to_bare_consumer` is telemetry's rate over that one's.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from datetime import datetime, timedelta

import asyncpg
import nats
from nats.aio.msg import Msg
from nats.js.api import ConsumerConfig

from vigil.events import LaunchJob, RankPlacement, StepCompleted, utcnow
from vigil.spec import JobSpec
from vigil_bench import measure_on_servers, result, start_service, stop_service
from vigil_common import subjects
from vigil_common.bus import Bus
from vigil_common.db import create_pool, migrate
from vigil_common.service import settle_heap
from vigil_common.settings import Settings
from vigil_telemetry import main as telemetry
from vigil_telemetry import store

N = 30_000
RANKS = 8


def _events(job: str) -> list[StepCompleted]:
    t0 = utcnow()
    return [
        StepCompleted(
            job_id=job,
            attempt=1,
            rank=i % RANKS,
            node=f"n{i % RANKS // 4}",
            step=i // RANKS,
            loss=3.0 - i * 1e-5,
            local_finite=True,
            grad_norm=1.0,
            lr=3e-4,
            tokens=4096,
            tokens_per_s=50_000.0,
            data_time_s=0.001,
            forward_time_s=0.03,
            backward_time_s=0.06,
            comm_time_s=0.01,
            optimizer_time_s=0.005,
            step_time_s=0.11,
            mem_allocated_bytes=1 << 30,
            mem_peak_bytes=2 << 30,
            data_position=i // RANKS,
            occurred_at=t0 + timedelta(milliseconds=i),
        )
        for i in range(N)
    ]


def _launch(job: str) -> LaunchJob:
    """The launch that places the events' ranks on their nodes (four ranks a node)."""
    return LaunchJob(
        job_id=job,
        attempt=1,
        spec=JobSpec(name="bench-ingest", resources={"nodes": RANKS // 4, "gpus_per_node": 4}),
        placement=[
            RankPlacement(rank=r, node=f"n{r // 4}", device=r % 4, local_rank=r % 4) for r in range(RANKS)
        ],
        master_addr="127.0.0.1",
        master_port=29500,
    )


async def _copy_floor(pool: asyncpg.Pool, events: list[StepCompleted]) -> float:
    """Seconds for a raw COPY of the rows into a fresh table shaped like telemetry_steps."""
    rows = store.step_rows(events)
    async with pool.acquire() as conn:
        await conn.execute("DROP TABLE IF EXISTS bench_copy_steps")
        await conn.execute("CREATE TABLE bench_copy_steps (LIKE telemetry_steps INCLUDING ALL)")
        try:
            t = time.perf_counter()
            await conn.copy_records_to_table(
                "bench_copy_steps", records=rows, columns=list(store.STEP_FIELDS)
            )
            return time.perf_counter() - t
        finally:
            await conn.execute("DROP TABLE bench_copy_steps")


async def _bare_consumer_rate(settings: Settings, pool: asyncpg.Pool, job: str) -> float:
    """Seconds for a bare nats-py push consumer to COPY the job's backlog into a table like telemetry's.

    Shaped like telemetry's consumer (the server pushes into a buffer while a batch is written, at
    most as many unacknowledged, batches of the same size) so that only Vigil's own code differs.
    """
    assert settings.nats_url
    nc = await nats.connect(settings.nats_url)
    fields = store.STEP_FIELDS
    spec = telemetry.STEPS
    buffer: list[Msg] = []
    arrived = asyncio.Event()

    async def on_msg(msg: Msg) -> None:
        buffer.append(msg)
        arrived.set()

    try:
        async with pool.acquire() as conn:
            await conn.execute("DROP TABLE IF EXISTS bench_bare_steps")
            await conn.execute("CREATE TABLE bench_bare_steps (LIKE telemetry_steps INCLUDING ALL)")
            try:
                t = time.perf_counter()
                sub = await nc.jetstream().subscribe(
                    subjects.stored(subjects.job_steps(job)),  # as VIGIL_JOBS stores them
                    durable="bench-bare-" + uuid.uuid4().hex[:8],
                    stream=subjects.stream_for(subjects.job_steps(job)).name,
                    cb=on_msg,
                    manual_ack=True,
                    config=ConsumerConfig(max_ack_pending=spec.max_ack_pending, ack_wait=spec.ack_wait_s),
                    pending_msgs_limit=4 * spec.max_ack_pending,
                )
                done = 0
                while done < N:
                    if not buffer:
                        arrived.clear()
                        await asyncio.wait_for(arrived.wait(), 10)
                    batch, buffer[:] = buffer[: telemetry.STEP_BATCH], buffer[telemetry.STEP_BATCH :]
                    rows = []
                    for m in batch:
                        d = json.loads(m.data)
                        d["occurred_at"] = datetime.fromisoformat(d["occurred_at"])
                        rows.append(tuple(d.get(f) for f in fields))
                    await conn.copy_records_to_table("bench_bare_steps", records=rows, columns=list(fields))
                    for m in batch:
                        await m.ack()
                    done += len(batch)
                elapsed = time.perf_counter() - t
                await sub.unsubscribe()
                return elapsed
            finally:
                await conn.execute("DROP TABLE bench_bare_steps")
    finally:
        await nc.close()


async def _telemetry_rate(settings: Settings, pool: asyncpg.Pool, job: str) -> tuple[float, int, float]:
    """(seconds, rows, startup seconds) for telemetry, as its own process (as in production), to store
    the job's backlog."""
    started = time.perf_counter()
    service, _ = await start_service(settings, "vigil_telemetry.main")
    try:
        first_t = first_n = None
        while True:
            n = await pool.fetchval("SELECT count(*) FROM telemetry_steps WHERE job_id = $1", job)
            now = time.perf_counter()
            if n and first_t is None:
                first_t, first_n = now, n
            if n >= N:
                assert first_t is not None and first_n is not None
                return now - first_t, N - first_n, first_t - started
            if service.returncode is not None:
                raise RuntimeError(f"telemetry stopped early (exit {service.returncode})")
            await asyncio.sleep(0.02)  # polling the row count
    finally:
        await stop_service(service)


async def _measure(settings: Settings) -> dict[str, object]:
    assert settings.nats_url and settings.database_url
    pool = await create_pool(settings.database_url)
    bus = await Bus.connect(settings.nats_url, "bench-ingest")
    try:
        await migrate(pool)
        await bus.ensure_streams()
        job = "bench-" + uuid.uuid4().hex[:10]
        events = _events(job)
        # the job's launch, stored first: telemetry admits a step only from a node that runs its rank
        await bus.publish(subjects.launch(job), _launch(job))
        for i in range(0, N, 1000):
            await asyncio.gather(*(bus.publish(subjects.step(job, e.node), e) for e in events[i : i + 1000]))
        settle_heap()  # the floors run under the collector settings telemetry's own process has
        copy_s = await _copy_floor(pool, events)
        bare_rate = N / await _bare_consumer_rate(settings, pool, job)
        tele_s, tele_n, startup_s = await _telemetry_rate(settings, pool, job)
        copy_rate, tele_rate = N / copy_s, tele_n / tele_s
        copy_s2 = await _copy_floor(pool, events)  # again after, so machine drift hits both
        copy_rate = (copy_rate + N / copy_s2) / 2
        stored = await pool.fetchval("SELECT count(*) FROM telemetry_steps WHERE job_id = $1", job)
        await pool.execute("DELETE FROM telemetry_steps WHERE job_id = $1", job)
        await pool.execute("DELETE FROM telemetry_job_progress WHERE job_id = $1", job)
        await pool.execute("DELETE FROM telemetry_step_aggregates WHERE job_id = $1", job)
        await pool.execute("DELETE FROM telemetry_step_buckets WHERE job_id = $1", job)
        await bus.js.purge_stream(subjects.JOBS.name, subject=subjects.stored(subjects.job_steps(job)))
    finally:
        await bus.close()
        await pool.close()
    return result(
        "ingest",
        value=tele_rate,
        floor=copy_rate,
        unit="step events persisted per second",
        target="ratio >= 0.5",
        events=N,
        telemetry_events_per_s=round(tele_rate, 1),
        raw_copy_rows_per_s=round(copy_rate, 1),
        bare_consumer_events_per_s=round(bare_rate, 1),
        ratio_to_bare_consumer=round(tele_rate / bare_rate, 4),
        rows_stored=stored,
        telemetry_startup_s=round(startup_s, 3),
    )


async def run(settings: Settings) -> dict[str, object]:
    return await measure_on_servers(_measure, settings)
