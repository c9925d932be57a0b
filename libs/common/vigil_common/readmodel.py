"""The read side of telemetry's tables (migrations 0003, 0009), for the gateway.

Every list is a page (`vigil_common.pages.Page`): `{"items": [...], "next": cursor | None}`,
in a stable key order, so a cursor never skips or repeats an item.
"""

from __future__ import annotations

import json
from typing import Any

import asyncpg

from vigil_common.pages import Page, check_limit, decode_cursor, page

_STEP_FIELDS = """step, rank, attempt, node, loss, grad_norm, lr, tokens, tokens_per_s, step_time_s,
    data_time_s, forward_time_s, backward_time_s, comm_time_s, optimizer_time_s, mem_allocated_bytes,
    mem_peak_bytes, skipped, data_position, occurred_at"""


async def steps(
    pool: asyncpg.Pool,
    job_id: str,
    *,
    rank: int | None = None,
    attempt: int | None = None,
    aggregate: bool = False,
    limit: int = 100,
    cursor: str | None = None,
) -> Page:
    """Step metrics of a job in (attempt, step) order.

    Per rank (optionally one `rank`): every event, including steps re-run after a rollback
    (later `occurred_at`), for as long as raw rows are kept (VIGIL_STEP_RETENTION_DAYS).
    Aggregated: one item per (attempt, step) over the newest event of each rank: mean loss and
    grad norm, summed tokens/s, the slowest step and communication times, and how many ranks
    reported; kept for the job's life. A per-rank first page of a job whose raw rows are all gone
    (no `rank` asked) is the aggregated one, so a reader of an old job still gets its curve.
    """
    check_limit(limit)
    if aggregate:
        return await _aggregated(pool, job_id, attempt=attempt, limit=limit, cursor=cursor)
    key = decode_cursor(cursor, ("int", "int", "int", "bigint"))  # attempt, step, rank, seq
    rows = await pool.fetch(
        f"""SELECT {_STEP_FIELDS}, seq FROM telemetry_steps
            WHERE job_id = $1 AND ($2::int IS NULL OR rank = $2) AND ($3::int IS NULL OR attempt = $3)
              AND ($4::int IS NULL OR (attempt, step, rank, seq) > ($4, $5::int, $6::int, $7::bigint))
            ORDER BY attempt, step, rank, seq LIMIT $8""",
        job_id,
        rank,
        attempt,
        *(key or (None, None, None, None)),
        limit + 1,
    )
    if not rows and cursor is None and rank is None:
        return await _aggregated(pool, job_id, attempt=attempt, limit=limit, cursor=None)
    return page(rows, limit, ("attempt", "step", "rank", "seq"), hidden=("seq",))


async def _aggregated(
    pool: asyncpg.Pool, job_id: str, *, attempt: int | None, limit: int, cursor: str | None
) -> Page:
    """From `telemetry_step_aggregates` (migration 0009), which a trigger keeps as steps arrive."""
    key = decode_cursor(cursor, ("int", "int"))  # attempt, step
    rows = await pool.fetch(
        """SELECT step, NULL::int AS rank, attempt, ranks, loss, grad_norm, lr, tokens, tokens_per_s,
                  step_time_s, comm_time_s, skipped, occurred_at
           FROM telemetry_step_aggregates
           WHERE job_id = $1 AND ($2::int IS NULL OR attempt = $2)
             AND ($3::int IS NULL OR (attempt, step) > ($3, $4::int))
           ORDER BY attempt, step LIMIT $5""",
        job_id,
        attempt,
        *(key or (None, None)),
        limit + 1,
    )
    return page(rows, limit, ("attempt", "step"))


async def checkpoints(
    pool: asyncpg.Pool, job_id: str, *, limit: int = 100, cursor: str | None = None
) -> Page:
    """A job's checkpoints by step: step, path, valid, bytes, created_at (and attempt, data_position)."""
    check_limit(limit)
    key = decode_cursor(cursor, ("int",))  # step
    rows = await pool.fetch(
        """SELECT step, path, valid, bytes, created_at, attempt, data_position, manifest_sha256
           FROM telemetry_checkpoints WHERE job_id = $1 AND ($2::int IS NULL OR step > $2)
           ORDER BY step LIMIT $3""",
        job_id,
        key[0] if key else None,
        limit + 1,
    )
    return page(rows, limit, ("step",))


async def incidents(
    pool: asyncpg.Pool, *, job_id: str | None = None, limit: int = 100, cursor: str | None = None
) -> Page:
    """Incidents, newest first: id, job_id, kind, step, rank, node, action, evidence, occurred_at
    (and attempt, device, message)."""
    check_limit(limit)
    key = decode_cursor(cursor, ("bigint",))  # seq
    rows = await pool.fetch(
        """SELECT id, job_id, attempt, kind, action, step, rank, node, device, message, evidence, occurred_at,
                  seq
           FROM telemetry_incidents
           WHERE ($1::text IS NULL OR job_id = $1) AND ($2::bigint IS NULL OR seq < $2)
           ORDER BY seq DESC LIMIT $3""",
        job_id,
        key[0] if key else None,
        limit + 1,
    )
    out = page(rows, limit, ("seq",), hidden=("seq",))
    for item in out["items"]:
        item["evidence"] = json.loads(item["evidence"])
    return out


_GPU_FIELDS = """node, index, device_kind, uuid, job_id, utilization_pct, memory_used_bytes,
    memory_total_bytes, temperature_c, power_w, sm_clock_mhz, mem_clock_mhz, throttle_reasons, ecc_corrected,
    ecc_uncorrected, xid, occurred_at"""


async def gpu_samples(
    pool: asyncpg.Pool, *, node: str, index: int, limit: int = 100, cursor: str | None = None
) -> Page:
    """One device's samples, newest first."""
    check_limit(limit)
    key = decode_cursor(cursor, ("timestamptz", "text"))  # occurred_at, event_id
    rows = await pool.fetch(
        f"""SELECT {_GPU_FIELDS}, event_id FROM telemetry_gpu_samples
            WHERE node = $1 AND index = $2
              AND ($3::timestamptz IS NULL OR (occurred_at, event_id) < ($3, $4::text))
            ORDER BY occurred_at DESC, event_id DESC LIMIT $5""",
        node,
        index,
        *(key or (None, None)),
        limit + 1,
    )
    out = page(rows, limit, ("occurred_at", "event_id"), hidden=("event_id",))
    for item in out["items"]:
        item["throttle_reasons"] = list(item["throttle_reasons"])
    return out


async def latest_gpu_samples(pool: asyncpg.Pool) -> dict[tuple[str, int], dict[str, Any]]:
    """The newest sample of every device that has reported: (node, index) -> sample."""
    rows = await pool.fetch("SELECT node, index, sample FROM telemetry_gpu_latest")
    return {(r["node"], r["index"]): json.loads(r["sample"]) for r in rows}


async def job_progress(pool: asyncpg.Pool, job_ids: list[str]) -> dict[str, dict[str, Any]]:
    """{job_id: {"last_step": int, "loss": float, "attempt": int}} for jobs that have made steps."""
    rows = await pool.fetch(
        "SELECT job_id, attempt, last_step, loss FROM telemetry_job_progress WHERE job_id = ANY($1::text[])",
        list(job_ids),
    )
    return {
        r["job_id"]: {"last_step": r["last_step"], "loss": r["loss"], "attempt": r["attempt"]} for r in rows
    }
