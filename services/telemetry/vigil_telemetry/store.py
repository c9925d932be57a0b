"""Writes batches of events to telemetry's tables (migrations 0003, 0009, 0013), one row per event_id.

Steps go to the time-partitioned `telemetry_steps` (see `partitions`); a trigger there keeps the
per-step aggregates across ranks (`telemetry_step_aggregates`), which outlive the raw rows, and the
writer adds each batch's new steps to the console's downsampled curves (`telemetry_step_buckets`).
The step columns are `vigil_common.step_columns.STEP_COLUMNS` (re-exported here).

Each writer takes a connection inside the caller's transaction and inserts a whole batch at once
(steps: COPY; the others: one `INSERT ... SELECT FROM unnest(...)`), and an event already stored
is skipped (`ON CONFLICT DO NOTHING` on the event id), so a redelivered event never becomes a
second row.
"""

from __future__ import annotations

import json
import operator
from collections.abc import Sequence
from typing import Any

import asyncpg

from vigil.events import (
    CheckpointSaved,
    GpuSampled,
    IncidentRaised,
    Message,
    RollbackCompleted,
    StepCompleted,
)
from vigil_common.step_columns import BUCKET_COLUMNS, BUCKET_WIDTHS, SERIES_METRICS, STEP_COLUMNS, STEP_FIELDS

__all__ = ["STEP_COLUMNS", "STEP_FIELDS"]  # and the writers below

_STEP_NAMES = ", ".join(STEP_FIELDS)
# A per-session staging table: COPY the batch in (the fastest way into Postgres), then move it
# with one INSERT ... ON CONFLICT DO NOTHING. Its rows vanish at commit.
CREATE_STAGE = (
    "CREATE TEMP TABLE IF NOT EXISTS stage_steps ("
    + ", ".join(f"{n} {t}" for n, t in STEP_COLUMNS)
    + ") ON COMMIT DELETE ROWS"
)
MOVE_STAGE = (
    f"INSERT INTO telemetry_steps ({_STEP_NAMES}) SELECT {_STEP_NAMES} FROM stage_steps "
    "ON CONFLICT (event_id, occurred_at) DO NOTHING RETURNING event_id"
)

_NONFINITE = "('NaN', 'Infinity', '-Infinity')"
_CLEANED = ", ".join(  # a non-finite value becomes NULL (aggregates skip it) and is counted apart
    f"CASE WHEN {m} IN {_NONFINITE} THEN NULL ELSE {m} END AS {m}, "
    f"COALESCE({m} IN {_NONFINITE}, false) AS {m}_bad"
    for m in SERIES_METRICS
)
_GROUPED = ", ".join(
    f"COALESCE(sum({m}), 0) AS {m}_sum, count({m})::int AS {m}_n, min({m}) AS {m}_lo, max({m}) AS {m}_hi, "
    f"count(*) FILTER (WHERE {m}_bad)::int AS {m}_bad"
    for m in SERIES_METRICS
)
_ROLLED_UP = ", ".join(
    f"sum({m}_sum), sum({m}_n)::int, min({m}_lo), max({m}_hi), sum({m}_bad)::int" for m in SERIES_METRICS
)
_MERGED = ", ".join(
    f"{m}_sum = b.{m}_sum + EXCLUDED.{m}_sum, {m}_n = b.{m}_n + EXCLUDED.{m}_n, "
    f"{m}_lo = LEAST(b.{m}_lo, EXCLUDED.{m}_lo), {m}_hi = GREATEST(b.{m}_hi, EXCLUDED.{m}_hi), "
    f"{m}_bad = b.{m}_bad + EXCLUDED.{m}_bad"
    for m in SERIES_METRICS
)
_METRIC_ARRAYS = ", ".join(f"${i}::float8[]" for i, _ in enumerate(SERIES_METRICS, start=4))
# The narrowest width: every stored width is a multiple of it (a test checks), so a wider bucket is a
# group of its buckets (for steps >= 0, step / width = (step / FINEST) / (width / FINEST)).
FINEST = BUCKET_WIDTHS[0]
# Each new step into its bucket at every stored width: the batch grouped by (job, rank, bucket) at the
# narrowest width, those groups grouped again at every width (sums and counts add, min and max widen:
# each row is read once, not once per width), then merged into the stored rows the same way. Rows go in
# key order, so two writers of the same buckets lock them in the same order.
ADD_TO_BUCKETS = f"""
    WITH finest AS (
        SELECT job_id, rank, step / {FINEST} AS bucket, min(step) AS first_step, max(step) AS last_step,
               {_GROUPED}
        FROM (SELECT job_id, rank, step, {_CLEANED}
              FROM unnest($1::text[], $2::int[], $3::int8[], {_METRIC_ARRAYS})
                   AS u(job_id, rank, step, {", ".join(SERIES_METRICS)})) s
        GROUP BY job_id, rank, step / {FINEST}
    )
    INSERT INTO telemetry_step_buckets AS b ({", ".join(name for name, _ in BUCKET_COLUMNS)})
    SELECT job_id, width, rank, bucket / (width / {FINEST}), min(first_step), max(last_step), {_ROLLED_UP}
    FROM finest CROSS JOIN unnest(${4 + len(SERIES_METRICS)}::int[]) AS w(width)
    GROUP BY job_id, width, rank, bucket / (width / {FINEST})
    ORDER BY 1, 2, 3, 4
    ON CONFLICT (job_id, width, rank, bucket) DO UPDATE SET
        first_step = LEAST(b.first_step, EXCLUDED.first_step),
        last_step = GREATEST(b.last_step, EXCLUDED.last_step), {_MERGED}"""

_PROGRESS = ("attempt", "last_step", "loss", "occurred_at", "mfu", "tokens_per_s")
_NEWER = ", ".join(
    f"{c} = CASE WHEN EXCLUDED.occurred_at >= p.occurred_at THEN EXCLUDED.{c} ELSE p.{c} END"
    for c in _PROGRESS
)
# The newest step per job (an older event leaves it as it is), and a revision every batch bumps.
UPDATE_PROGRESS = f"""
    INSERT INTO telemetry_job_progress AS p (job_id, {", ".join(_PROGRESS)}, revision)
    SELECT *, 1 FROM unnest($1::text[], $2::int[], $3::int8[], $4::float8[], $5::timestamptz[],
                            $6::float8[], $7::float8[])
    ON CONFLICT (job_id) DO UPDATE SET revision = p.revision + 1, {_NEWER}"""


_step_row = operator.itemgetter(*STEP_FIELDS)


def step_rows(events: Sequence[StepCompleted]) -> list[tuple[Any, ...]]:
    """Row tuples in STEP_COLUMNS order (also what the ingest bench COPYs)."""
    return [_step_row(e.__dict__) for e in events]  # a pydantic model keeps its fields in __dict__


async def write_steps(conn: asyncpg.Connection, events: Sequence[StepCompleted]) -> None:
    """Insert a batch of steps (inside the caller's transaction); events already stored are skipped.

    The batch is COPYed straight into the table under a savepoint: the common case, no event seen
    before, costs no more than a raw COPY. When the batch holds an event already stored (a
    redelivery after a crash), the savepoint is rolled back and the batch goes through the staging
    table and `ON CONFLICT DO NOTHING` instead. The steps stored now (never one stored before) go into
    the downsampled buckets; each job's progress row keeps its newest step.
    """
    if not events:
        return
    rows = step_rows(events)
    new: Sequence[StepCompleted] = events
    try:
        async with conn.transaction():
            await conn.copy_records_to_table("telemetry_steps", records=rows, columns=STEP_FIELDS)
    except asyncpg.UniqueViolationError:
        await conn.execute(CREATE_STAGE)
        await conn.copy_records_to_table("stage_steps", records=rows, columns=STEP_FIELDS)
        stored = {r["event_id"] for r in await conn.fetch(MOVE_STAGE)}
        new = [e for e in events if e.event_id in stored]
    await add_to_buckets(conn, new)
    newest: dict[str, StepCompleted] = {}
    for e in events:
        if e.job_id and (e.job_id not in newest or e.occurred_at >= newest[e.job_id].occurred_at):
            newest[e.job_id] = e
    latest = [newest[job] for job in sorted(newest)]  # in key order, like the buckets
    await conn.execute(
        UPDATE_PROGRESS,
        [e.job_id for e in latest],
        [e.attempt for e in latest],
        [e.step for e in latest],
        [e.loss for e in latest],
        [e.occurred_at for e in latest],
        [e.mfu for e in latest],
        [e.tokens_per_s for e in latest],
    )


async def add_to_buckets(conn: asyncpg.Connection, events: Sequence[StepCompleted]) -> None:
    """Add steps to their jobs' downsampled buckets at every stored width. Each step once: the caller
    passes only steps it has just stored."""
    events = [e for e in events if e.job_id]
    if not events:
        return
    await conn.execute(
        ADD_TO_BUCKETS,
        [e.job_id for e in events],
        [e.rank for e in events],
        [e.step for e in events],
        *([getattr(e, m) for e in events] for m in SERIES_METRICS),
        list(BUCKET_WIDTHS),
    )


GPU_FIELDS = (
    "event_id",
    "node",
    "index",
    "device_kind",
    "uuid",
    "job_id",
    "utilization_pct",
    "memory_used_bytes",
    "memory_total_bytes",
    "temperature_c",
    "power_w",
    "sm_clock_mhz",
    "mem_clock_mhz",
    "ecc_corrected",
    "ecc_uncorrected",
    "xid",
    "occurred_at",
)
GPU_TYPES = (
    "text",
    "text",
    "int",
    "text",
    "text",
    "text",
    "float8",
    "int8",
    "int8",
    "float8",
    "float8",
    "int",
    "int",
    "int8",
    "int8",
    "int",
    "timestamptz",
)


async def write_gpu(conn: asyncpg.Connection, events: Sequence[GpuSampled]) -> None:
    if not events:
        return
    columns = [[getattr(e, f) for e in events] for f in GPU_FIELDS]
    # text[] columns cannot travel through unnest as a 2-D array of ragged rows: pass them as JSON.
    reasons = [json.dumps(e.throttle_reasons) for e in events]
    names = ", ".join(GPU_FIELDS)
    arrays = ", ".join(f"${i}::{t}[]" for i, t in enumerate(GPU_TYPES, start=1))
    n = len(GPU_FIELDS) + 1
    await conn.execute(
        f"""INSERT INTO telemetry_gpu_samples ({names}, throttle_reasons)
            SELECT {_cols("u", GPU_FIELDS)}, ARRAY(SELECT jsonb_array_elements_text(u.r::jsonb))
            FROM unnest({arrays}, ${n}::text[]) AS u({names}, r)
            ON CONFLICT (event_id) DO NOTHING""",
        *columns,
        reasons,
    )
    newest: dict[tuple[str, int], GpuSampled] = {}
    for e in events:
        key = (e.node, e.index)
        if key not in newest or e.occurred_at >= newest[key].occurred_at:
            newest[key] = e
    latest = list(newest.values())
    await conn.execute(
        """INSERT INTO telemetry_gpu_latest (node, index, event_id, occurred_at, sample)
           SELECT * FROM unnest($1::text[], $2::int[], $3::text[], $4::timestamptz[], $5::jsonb[])
           ON CONFLICT (node, index) DO UPDATE SET event_id = EXCLUDED.event_id,
               occurred_at = EXCLUDED.occurred_at, sample = EXCLUDED.sample
           WHERE EXCLUDED.occurred_at >= telemetry_gpu_latest.occurred_at""",
        [e.node for e in latest],
        [e.index for e in latest],
        [e.event_id for e in latest],
        [e.occurred_at for e in latest],
        [_json(e) for e in latest],
    )


def _cols(alias: str, names: Sequence[str]) -> str:
    return ", ".join(f"{alias}.{n}" for n in names)


def _json(event: Message) -> str:
    """The event as JSON text for a jsonb column (non-finite floats as strings; no NUL characters)."""
    return event.model_dump_json().replace("\\u0000", "")


async def write_status(conn: asyncpg.Connection, events: Sequence[Message]) -> None:
    """Status events as they came, plus the checkpoints table (saved; superseded by a rollback)."""
    if not events:
        return
    await conn.execute(
        """INSERT INTO telemetry_status_events (event_id, job_id, attempt, type, occurred_at, payload)
           SELECT * FROM unnest($1::text[], $2::text[], $3::int[], $4::text[], $5::timestamptz[], $6::jsonb[])
           ON CONFLICT (event_id) DO NOTHING""",
        [e.event_id for e in events],
        [e.job_id for e in events],
        [e.attempt for e in events],
        [e.type for e in events],
        [e.occurred_at for e in events],
        [_json(e) for e in events],
    )
    saved = [e for e in events if isinstance(e, CheckpointSaved)]
    if saved:
        await conn.executemany(
            """INSERT INTO telemetry_checkpoints
                   (job_id, step, path, attempt, bytes, manifest_sha256, data_position, valid, event_id,
                    created_at)
               VALUES ($1, $2, $3, $4, $5, $6, $7, true, $8, $9)
               ON CONFLICT (job_id, step) DO UPDATE SET path = EXCLUDED.path, attempt = EXCLUDED.attempt,
                   bytes = EXCLUDED.bytes, manifest_sha256 = EXCLUDED.manifest_sha256,
                   data_position = EXCLUDED.data_position, valid = true, event_id = EXCLUDED.event_id,
                   created_at = EXCLUDED.created_at
               WHERE EXCLUDED.created_at > telemetry_checkpoints.created_at""",
            [
                (
                    e.job_id,
                    e.step,
                    e.path,
                    e.attempt,
                    e.bytes,
                    e.manifest_sha256,
                    e.data_position,
                    e.event_id,
                    e.occurred_at,
                )
                for e in saved
            ],
        )
    rollbacks = [e for e in events if isinstance(e, RollbackCompleted)]
    if rollbacks:
        # Checkpoints saved past a rollback's target before it belong to the abandoned timeline.
        await conn.executemany(
            """UPDATE telemetry_checkpoints SET valid = false
               WHERE job_id = $1 AND step > $2 AND created_at < $3""",
            [(e.job_id, e.to_step, e.occurred_at) for e in rollbacks],
        )


async def write_incidents(conn: asyncpg.Connection, events: Sequence[IncidentRaised]) -> None:
    if not events:
        return
    await conn.execute(
        """INSERT INTO telemetry_incidents
               (id, job_id, attempt, kind, action, step, rank, node, device, message, evidence, occurred_at)
           SELECT * FROM unnest($1::text[], $2::text[], $3::int[], $4::text[], $5::text[], $6::int8[],
                                $7::int[], $8::text[], $9::int[], $10::text[], $11::jsonb[],
                                $12::timestamptz[])
           ON CONFLICT (id) DO NOTHING""",
        [e.event_id for e in events],
        [e.job_id for e in events],
        [e.attempt for e in events],
        [e.kind for e in events],
        [e.action for e in events],
        [e.step for e in events],
        [e.rank for e in events],
        [e.node for e in events],
        [e.device for e in events],
        [e.message for e in events],
        [json.dumps(json.loads(_json(e))["evidence"]) for e in events],
        [e.occurred_at for e in events],
    )
