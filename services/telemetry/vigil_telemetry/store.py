"""Writes batches of events to telemetry's tables (migrations 0003, 0009), one row per event_id.

Steps go to the time-partitioned `telemetry_steps` (see `partitions`); a trigger there keeps the
per-step aggregates across ranks (`telemetry_step_aggregates`), which outlive the raw rows.

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

from vigil_common.events import (
    CheckpointSaved,
    GpuSampled,
    IncidentRaised,
    Message,
    RollbackCompleted,
    StepCompleted,
)

STEP_COLUMNS: tuple[tuple[str, str], ...] = (
    ("event_id", "text"),
    ("job_id", "text"),
    ("attempt", "int"),
    ("step", "int"),
    ("rank", "int"),
    ("node", "text"),
    ("loss", "float8"),
    ("grad_norm", "float8"),
    ("lr", "float8"),
    ("tokens", "int8"),
    ("tokens_per_s", "float8"),
    ("data_time_s", "float8"),
    ("forward_time_s", "float8"),
    ("backward_time_s", "float8"),
    ("comm_time_s", "float8"),
    ("optimizer_time_s", "float8"),
    ("step_time_s", "float8"),
    ("mem_allocated_bytes", "int8"),
    ("mem_peak_bytes", "int8"),
    ("skipped", "bool"),
    ("data_position", "int8"),
    ("occurred_at", "timestamptz"),
)
STEP_FIELDS = tuple(name for name, _ in STEP_COLUMNS)


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
    "ON CONFLICT (event_id, occurred_at) DO NOTHING"
)


_step_row = operator.itemgetter(*STEP_FIELDS)


def step_rows(events: Sequence[StepCompleted]) -> list[tuple[Any, ...]]:
    """Row tuples in STEP_COLUMNS order (also what the ingest bench COPYs)."""
    return [_step_row(e.__dict__) for e in events]  # a pydantic model keeps its fields in __dict__


async def write_steps(conn: asyncpg.Connection, events: Sequence[StepCompleted]) -> None:
    """Insert a batch of steps (inside the caller's transaction); events already stored are skipped.

    The batch is COPYed straight into the table under a savepoint: the common case, no event seen
    before, costs no more than a raw COPY. When the batch holds an event already stored (a
    redelivery after a crash), the savepoint is rolled back and the batch goes through the staging
    table and `ON CONFLICT DO NOTHING` instead.
    """
    if not events:
        return
    rows = step_rows(events)
    try:
        async with conn.transaction():
            await conn.copy_records_to_table("telemetry_steps", records=rows, columns=STEP_FIELDS)
    except asyncpg.UniqueViolationError:
        await conn.execute(CREATE_STAGE)
        await conn.copy_records_to_table("stage_steps", records=rows, columns=STEP_FIELDS)
        await conn.execute(MOVE_STAGE)
    newest: dict[str, StepCompleted] = {}
    for e in events:
        if e.job_id and (e.job_id not in newest or e.occurred_at >= newest[e.job_id].occurred_at):
            newest[e.job_id] = e
    latest = list(newest.values())
    await conn.execute(
        """INSERT INTO telemetry_job_progress (job_id, attempt, last_step, loss, occurred_at)
           SELECT * FROM unnest($1::text[], $2::int[], $3::int[], $4::float8[], $5::timestamptz[])
           ON CONFLICT (job_id) DO UPDATE SET attempt = EXCLUDED.attempt, last_step = EXCLUDED.last_step,
               loss = EXCLUDED.loss, occurred_at = EXCLUDED.occurred_at
           WHERE EXCLUDED.occurred_at >= telemetry_job_progress.occurred_at""",
        [e.job_id for e in latest],
        [e.attempt for e in latest],
        [e.step for e in latest],
        [e.loss for e in latest],
        [e.occurred_at for e in latest],
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
           SELECT * FROM unnest($1::text[], $2::text[], $3::int[], $4::text[], $5::text[], $6::int[],
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
