"""The audit record (migration 0009's `audit_log`, append-only: a trigger refuses UPDATE, DELETE and
TRUNCATE): who asked for each submit, cancel, halt, rollback and resume, and who cleared a device's
mark (`clear_device_mark`, migration 0015).

Who: `token:<fingerprint>` for the API (the first 12 hex digits of the bearer token's SHA-256, never
the token), `service:<name>` for a command seen on the bus (the publisher's connection name, from
the `Vigil-Service` header; only the scheduler's and guardian's NATS credentials may publish
commands, see `vigil_common.credentials`).
"""

from __future__ import annotations

import hashlib
import json
from typing import Any, Literal

import asyncpg

from vigil_common.pages import Page, check_limit, decode_cursor, page

Action = Literal["submit", "cancel", "halt", "rollback", "resume", "clear_device_mark"]


def token_actor(token: str) -> str:
    return "token:" + hashlib.sha256(token.encode()).hexdigest()[:12]


def service_actor(name: str | None) -> str:
    return f"service:{name or 'unknown'}"


async def record(
    conn: asyncpg.Connection,
    action: Action,
    actor: str,
    job_id: str | None,
    attempt: int | None = None,
    *,
    event_id: str | None = None,
    detail: dict[str, Any] | None = None,
) -> None:
    """Append one record (inside the caller's transaction); a command's redelivery adds none."""
    await conn.execute(
        """INSERT INTO audit_log (action, actor, job_id, attempt, event_id, detail)
           VALUES ($1, $2, $3, $4, $5, $6::jsonb) ON CONFLICT (event_id) DO NOTHING""",
        action,
        actor,
        job_id,
        attempt,
        event_id,
        json.dumps(detail or {}),
    )


async def list_records(
    pool: asyncpg.Pool, *, job_id: str | None = None, limit: int = 100, cursor: str | None = None
) -> Page:
    """Newest first: seq, occurred_at, action, job_id, attempt, actor, event_id, detail."""
    check_limit(limit)
    key = decode_cursor(cursor, ("bigint",))
    rows = await pool.fetch(
        """SELECT seq, occurred_at, action, job_id, attempt, actor, event_id, detail FROM audit_log
           WHERE ($1::text IS NULL OR job_id = $1) AND ($2::bigint IS NULL OR seq < $2)
           ORDER BY seq DESC LIMIT $3""",
        job_id,
        key[0] if key else None,
        limit + 1,
    )
    items = [{**dict(r), "detail": json.loads(r["detail"])} for r in rows]
    return page(items, limit, ("seq",))
