"""The read side of telemetry's tables, for the gateway and the console: steps, checkpoints, incidents,
GPU samples, and the console's downsampled curves. The tables' columns are `vigil_common.step_columns`.

Every list is a page (`vigil_common.pages.Page`): `{"items": [...], "next": cursor | None}`,
in a stable key order, so a cursor never skips or repeats an item.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

import asyncpg

from vigil_common.pages import Page, check_limit, decode_cursor, page
from vigil_common.step_columns import BUCKET_WIDTHS, SERIES_METRICS, STEP_FIELDS
from vigil_common.visibility import sees_job_of

_STEP_FIELDS = ", ".join(f for f in STEP_FIELDS if f not in ("event_id", "job_id"))  # a job's page of steps


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

    Per rank (optionally one `rank`): every event, for as long as raw rows are kept
    (VIGIL_STEP_RETENTION_DAYS), in (attempt, step, rank, generation) order. A step re-run after an
    in-place rollback is a second row with the next `generation` (0: the attempt's first run, +1 after
    each in-place rollback), so the abandoned run and the re-run are both there.
    Aggregated: one item per (attempt, step) over the step's last run (its highest `generation`, the
    newest event of each rank of it): mean loss, grad norm and MFU, summed tokens/s, the slowest step
    and communication times, and how many ranks reported; kept for the job's life. A per-rank first
    page of a job whose raw rows are all gone (no `rank` asked) is the aggregated one, so a reader of
    an old job still gets its curve.
    """
    check_limit(limit)
    if aggregate:
        return await _aggregated(pool, job_id, attempt=attempt, limit=limit, cursor=cursor)
    key = decode_cursor(cursor, ("int", "bigint", "int", "int", "bigint"))  # attempt, step, rank, gen, seq
    rows = await pool.fetch(
        f"""SELECT {_STEP_FIELDS}, seq FROM telemetry_steps
            WHERE job_id = $1 AND ($2::int IS NULL OR rank = $2) AND ($3::int IS NULL OR attempt = $3)
              AND ($4::int IS NULL OR (attempt, step, rank, generation, seq)
                                      > ($4, $5::bigint, $6::int, $7::int, $8::bigint))
            ORDER BY attempt, step, rank, generation, seq LIMIT $9""",
        job_id,
        rank,
        attempt,
        *(key or (None, None, None, None, None)),
        limit + 1,
    )
    if not rows and cursor is None and rank is None:
        return await _aggregated(pool, job_id, attempt=attempt, limit=limit, cursor=None)
    return page(rows, limit, ("attempt", "step", "rank", "generation", "seq"), hidden=("seq",))


async def _aggregated(
    pool: asyncpg.Pool, job_id: str, *, attempt: int | None, limit: int, cursor: str | None
) -> Page:
    """From `telemetry_step_aggregates` (migrations 0009, 0017), which a trigger keeps as steps arrive."""
    key = decode_cursor(cursor, ("int", "bigint"))  # attempt, step
    rows = await pool.fetch(
        """SELECT step, NULL::int AS rank, attempt, generation, ranks, loss, grad_norm, lr, tokens,
                  tokens_per_s, step_time_s, comm_time_s, skipped, occurred_at, flops_per_token, mfu,
                  micro_batch
           FROM telemetry_step_aggregates
           WHERE job_id = $1 AND ($2::int IS NULL OR attempt = $2)
             AND ($3::int IS NULL OR (attempt, step) > ($3, $4::bigint))
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
    key = decode_cursor(cursor, ("bigint",))  # step
    rows = await pool.fetch(
        """SELECT step, path, valid, bytes, created_at, attempt, data_position, manifest_sha256
           FROM telemetry_checkpoints WHERE job_id = $1 AND ($2::bigint IS NULL OR step > $2)
           ORDER BY step LIMIT $3""",
        job_id,
        key[0] if key else None,
        limit + 1,
    )
    return page(rows, limit, ("step",))


async def incidents(
    pool: asyncpg.Pool,
    *,
    job_id: str | None = None,
    limit: int = 100,
    cursor: str | None = None,
    visible_to: tuple[str, str | None] | None = None,
) -> Page:
    """Incidents, newest first: id, job_id, kind, step, rank, node, action, evidence, occurred_at
    (and attempt, device, message). `visible_to` (owner, team): only incidents of the jobs that owner
    or team owns; None: all."""
    check_limit(limit)
    key = decode_cursor(cursor, ("bigint",))  # seq
    owner, team = visible_to or (None, None)
    rows = await pool.fetch(
        f"""SELECT id, job_id, attempt, kind, action, step, rank, node, device, message, evidence,
                  occurred_at, seq
           FROM telemetry_incidents
           WHERE ($1::text IS NULL OR job_id = $1) AND ($2::bigint IS NULL OR seq < $2) AND {sees_job_of(4)}
           ORDER BY seq DESC LIMIT $3""",
        job_id,
        key[0] if key else None,
        limit + 1,
        owner,
        team,
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
    """{job_id: {"last_step", "loss", "attempt", "mfu", "tokens_per_s"}} for jobs that have made steps
    (MFU and tokens/s: of the newest step's rank)."""
    rows = await pool.fetch(
        """SELECT job_id, attempt, last_step, loss, mfu, tokens_per_s FROM telemetry_job_progress
           WHERE job_id = ANY($1::text[])""",
        list(job_ids),
    )
    return {
        r["job_id"]: {k: r[k] for k in ("last_step", "loss", "attempt", "mfu", "tokens_per_s")} for r in rows
    }


# --- for the web console: downsampled curves, one step's phases, marks, counts ---------------------------


def shown_width(wanted: int) -> int:
    """The bucket width to show for at most `wanted` steps a point: the smallest at least `wanted` that
    the stored buckets serve cheaply, i.e. a stored width, or two of the widest stored width not over
    `wanted` (so never under half the points asked for, and never more than 2 stored rows a point); 1
    and 2 come from the raw rows."""
    if wanted <= 2:
        return max(wanted, 1)
    w = max((b for b in BUCKET_WIDTHS if b <= wanted), default=1)
    if wanted == w:
        return w
    if wanted <= 2 * w:
        return 2 * w
    if 4 * w in BUCKET_WIDTHS:
        return 4 * w
    return w * -(-wanted // w)  # past the widest: a multiple of it


def _stored_width(bucket: int) -> int | None:
    """The widest stored width that divides `bucket` (None: read the raw rows)."""
    return max((w for w in BUCKET_WIDTHS if bucket % w == 0), default=None)


async def step_buckets(pool: asyncpg.Pool, job_id: str, *, bucket: int) -> list[Mapping[str, Any]]:
    """A job's step metrics downsampled on the server: one row per (rank, `bucket` consecutive steps)
    over every stored event (abandoned runs and re-runs after an in-place rollback both, so a NaN or
    spike that was rolled back still shows), with the first and last step, and per metric the mean,
    count, min and max of the finite values and how many were not finite (`<metric>_bad`).
    `abandoned_buckets` says how much of each came from runs a rollback abandoned.

    A `bucket` that a stored width divides (`shown_width` gives one) merges the stored buckets:
    about two rows a point, however many steps the job has; any other is one pass over the raw rows.
    """
    if bucket < 1:
        raise ValueError(f"bucket must be >= 1, got {bucket}")
    stored = _stored_width(bucket)
    if stored is None:
        return await _raw_buckets(pool, job_id, bucket)
    merged = ", ".join(
        f"sum({m}_sum) / NULLIF(sum({m}_n), 0) AS {m}, sum({m}_n)::int AS {m}_n, min({m}_lo) AS {m}_lo, "
        f"max({m}_hi) AS {m}_hi, sum({m}_bad)::int AS {m}_bad"
        for m in SERIES_METRICS
    )
    rows = await pool.fetch(
        f"""SELECT rank, bucket / $3 AS bucket, min(first_step) AS first_step, max(last_step) AS last_step,
                   {merged}
            FROM telemetry_step_buckets WHERE job_id = $1 AND width = $2
            GROUP BY rank, bucket / $3 ORDER BY rank, 2""",  # in the key's order: no sort
        job_id,
        stored,
        bucket // stored,
    )
    return rows  # records (a mapping each): 32,000 of them for 64 ranks, not copied into dicts


async def _raw_buckets(pool: asyncpg.Pool, job_id: str, bucket: int) -> list[Mapping[str, Any]]:
    nonfinite = "('NaN', 'Infinity', '-Infinity')"
    # non-finite values become NULL once (aggregates skip NULLs), and are counted apart
    cleaned = ", ".join(
        f"CASE WHEN {m} IN {nonfinite} THEN NULL ELSE {m} END AS {m}, {m} IN {nonfinite} AS {m}_nonfinite"
        for m in SERIES_METRICS
    )
    per_metric = ", ".join(
        f"avg({m}) AS {m}, count({m})::int AS {m}_n, min({m}) AS {m}_lo, max({m}) AS {m}_hi, "
        f"count(*) FILTER (WHERE {m}_nonfinite)::int AS {m}_bad"
        for m in SERIES_METRICS
    )
    rows = await pool.fetch(
        f"""SELECT rank, bucket, min(step) AS first_step, max(step) AS last_step, {per_metric}
            FROM (SELECT rank, step / $2 AS bucket, step, {cleaned} FROM telemetry_steps WHERE job_id = $1) s
            GROUP BY rank, bucket ORDER BY bucket, rank""",
        job_id,
        bucket,
    )
    return rows


async def abandoned_buckets(pool: asyncpg.Pool, job_id: str, *, bucket: int) -> list[Mapping[str, Any]]:
    """The part of `step_buckets` that came from abandoned runs: per (rank, `bucket` consecutive steps),
    the raw rows an in-place rollback left behind (the same rank ran the same step of the same attempt
    again, with a higher `generation`), with per metric the sum and count of the finite values (`<metric>`
    is their mean). Empty for a job without a stored rollback (no scan), and once the raw rows are past
    retention (the curve then keeps them in with the re-run)."""
    if bucket < 1:
        raise ValueError(f"bucket must be >= 1, got {bucket}")
    nonfinite = "('NaN', 'Infinity', '-Infinity')"
    cleaned = ", ".join(f"CASE WHEN {m} IN {nonfinite} THEN NULL ELSE {m} END AS {m}" for m in SERIES_METRICS)
    per_metric = ", ".join(
        f"avg({m}) AS {m}, COALESCE(sum({m}), 0) AS {m}_sum, count({m})::int AS {m}_n" for m in SERIES_METRICS
    )
    rows = await pool.fetch(
        f"""WITH rollbacks AS (
                SELECT attempt, (payload->>'to_step')::int8 AS lo, (payload->>'from_step')::int8 AS hi
                FROM telemetry_status_events WHERE job_id = $1 AND type = 'rollback.completed')
            SELECT rank, bucket, min(step) AS first_step, max(step) AS last_step, {per_metric}
            FROM (SELECT rank, step / $2 AS bucket, step, {cleaned}
                  FROM telemetry_steps s
                  WHERE s.job_id = $1 AND EXISTS (SELECT 1 FROM rollbacks)
                    AND s.step BETWEEN (SELECT min(lo) FROM rollbacks) AND (SELECT max(hi) FROM rollbacks)
                    AND EXISTS (SELECT 1 FROM telemetry_steps t
                                WHERE t.job_id = s.job_id AND t.attempt = s.attempt AND t.step = s.step
                                  AND t.rank = s.rank AND t.generation > s.generation)) a
            GROUP BY rank, bucket ORDER BY bucket, rank""",
        job_id,
        bucket,
    )
    return rows


async def step_phases(
    pool: asyncpg.Pool, job_id: str, step: int, *, attempt: int | None = None
) -> list[dict[str, Any]]:
    """Each rank's newest event for one step (of `attempt`, else of the newest attempt that ran it; of
    its last run, the highest generation): rank, node, attempt, generation and its data, forward,
    backward, comm, optimizer and step times."""
    rows = await pool.fetch(
        """SELECT DISTINCT ON (rank) rank, node, attempt, generation, step, data_time_s, forward_time_s,
                  backward_time_s, comm_time_s, optimizer_time_s, step_time_s, loss, skipped, occurred_at
           FROM telemetry_steps
           WHERE job_id = $1 AND step = $2 AND attempt = COALESCE($3::int,
                 (SELECT max(attempt) FROM telemetry_steps WHERE job_id = $1 AND step = $2))
           ORDER BY rank, generation DESC, seq DESC""",
        job_id,
        step,
        attempt,
    )
    return [dict(r) for r in rows]


async def step_marks(pool: asyncpg.Pool, job_id: str) -> dict[str, list[dict[str, Any]]]:
    """What to mark on a job's curves besides incidents: halts (step), rollbacks (from, to, the skipped
    data window) from the stored status events, and where each attempt's steps began (its first step,
    and when the last rank finished that step)."""
    events = await pool.fetch(
        """SELECT type, attempt, payload, occurred_at FROM telemetry_status_events
           WHERE job_id = $1 AND type IN ('ranks.halted', 'rollback.completed') ORDER BY seq""",
        job_id,
    )
    halts, rollbacks = [], []
    for r in events:
        p = json.loads(r["payload"])
        if r["type"] == "ranks.halted":
            halts.append({"attempt": r["attempt"], "step": p["step"], "occurred_at": r["occurred_at"]})
        else:
            rollbacks.append(
                {
                    "attempt": r["attempt"],
                    "from_step": p["from_step"],
                    "to_step": p["to_step"],
                    "skip_data": p.get("skip_data"),
                    "checkpoint": p["checkpoint"],
                    "duration_s": p["duration_s"],
                    "occurred_at": r["occurred_at"],
                }
            )
    attempts = [  # from the per-step aggregates: a row per step, not per rank-step
        dict(r)
        for r in await pool.fetch(
            """SELECT attempt, min(step) AS first_step, min(occurred_at) AS started_at
               FROM telemetry_step_aggregates WHERE job_id = $1 GROUP BY attempt ORDER BY attempt""",
            job_id,
        )
    ]
    return {"halts": halts, "rollbacks": rollbacks, "attempts": attempts}


async def incident_counts(pool: asyncpg.Pool, job_ids: list[str]) -> dict[str, int]:
    """{job_id: number of incidents} for the jobs that have any."""
    rows = await pool.fetch(
        """SELECT job_id, count(*)::int AS n FROM telemetry_incidents
           WHERE job_id = ANY($1::text[]) GROUP BY job_id""",
        list(job_ids),
    )
    return {r["job_id"]: r["n"] for r in rows}


async def job_version(pool: asyncpg.Pool, job_id: str) -> str | None:
    """What a job's console page shows, as one string that changes whenever any of it does (None: no
    such job): the job's row (the scheduler sets `updated_at` on every change), its steps (the progress
    row's `revision`, which the telemetry writer bumps with every batch of the job's steps, buckets and
    aggregates written in the same transaction), its status events (halts, rollbacks, checkpoints), its
    incidents and the guardian settings changes the guardian has applied (migration 0023). Index lookups
    only: cheap enough to ask every second."""
    row = await pool.fetchrow(
        """SELECT j.updated_at, p.revision,
                  (SELECT max(seq) FROM telemetry_status_events WHERE job_id = $1) AS status_seq,
                  (SELECT max(seq) FROM telemetry_incidents WHERE job_id = $1) AS incident_seq,
                  (SELECT count(from_step) FROM guardian_settings_changes WHERE job_id = $1) AS applied
           FROM jobs j LEFT JOIN telemetry_job_progress p ON p.job_id = j.id WHERE j.id = $1""",
        job_id,
    )
    if row is None:
        return None
    return "{}.{}.{}.{}.{}".format(
        row["updated_at"].timestamp(),
        row["revision"] or 0,
        row["status_seq"] or 0,
        row["incident_seq"] or 0,
        row["applied"],
    )
