"""The audit record (migration 0009's `audit_log`, append-only: a trigger refuses UPDATE, DELETE and
TRUNCATE): who asked for each submit, cancel, halt, rollback and resume, who cleared a device's
mark (`clear_device_mark`, migration 0015), and (migration 0016) who created a user, issued or revoked
a token or set a quota.

Who is always the authenticated principal (`principals.Principal.actor`), never a name a client chose:
`user:<name>` for a user's token, `token:<fingerprint>` for the gateway's own (admin) token (the first
12 hex digits of its SHA-256, never the token). A command seen on the bus is `service:<role>`, where
role is one of the NATS roles the server lets publish commands (`credentials.command_publishers`);
the `Vigil-Service` header that names it is the publisher's claim among those roles, as NATS does not
tell a subscriber which user published (a name outside them is recorded as `service:unverified`).
"""

from __future__ import annotations

import hashlib
import json
from typing import Any, Literal

import asyncpg

from vigil_common import credentials
from vigil_common.pages import Page, check_limit, decode_cursor, page
from vigil_common.visibility import sees_job_of

Action = Literal[
    "submit",
    "cancel",
    "halt",
    "rollback",
    "restart",
    "resume",
    "clear_device_mark",
    "user",
    "token",
    "revoke",
    "quota",
    "preempt",  # the scheduler stopped a job for one of higher priority (`preempting`)
    "time_limit",  # the scheduler stopped an attempt past its scheduling.time_limit
    "guardian",  # a job's guardian settings changed at run time (`guardian_settings`, migration 0023)
    "alert_route",  # an alert route made or deleted (`alert_routes`, migration 0025)
]


def token_actor(token: str) -> str:
    return "token:" + hashlib.sha256(token.encode()).hexdigest()[:12]


def service_actor(name: str | None) -> str:
    """A bus command's actor: the publishing role, when it names one that may publish commands."""
    return f"service:{name}" if name in credentials.command_publishers() else "service:unverified"


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
    pool: asyncpg.Pool,
    *,
    job_id: str | None = None,
    limit: int = 100,
    cursor: str | None = None,
    visible_to: tuple[str, str | None] | None = None,
) -> Page:
    """Newest first: seq, occurred_at, action, job_id, attempt, actor, event_id, detail. `visible_to`
    (owner, team): only the records of the jobs that owner or team owns; None: all."""
    check_limit(limit)
    key = decode_cursor(cursor, ("bigint",))
    owner, team = visible_to or (None, None)
    rows = await pool.fetch(
        f"""SELECT seq, occurred_at, action, job_id, attempt, actor, event_id, detail FROM audit_log
           WHERE ($1::text IS NULL OR job_id = $1) AND ($2::bigint IS NULL OR seq < $2) AND {sees_job_of(4)}
           ORDER BY seq DESC LIMIT $3""",
        job_id,
        key[0] if key else None,
        limit + 1,
        owner,
        team,
    )
    items = [{**dict(r), "detail": json.loads(r["detail"])} for r in rows]
    return page(items, limit, ("seq",))
