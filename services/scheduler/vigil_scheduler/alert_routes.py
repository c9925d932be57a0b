"""Alert routes in Postgres (migration 0025): made, listed, deleted and their delivery log read, each for
who may see the route (`vigil_common.visibility.sees` on the route's owner and team, as for jobs). The
deliveries themselves are telemetry's (`vigil_telemetry.alerts`).

A `json` route gets a signing secret here, returned once by `create` and never read back by the API."""

from __future__ import annotations

import json
import secrets
import uuid
from typing import Any

import asyncpg

from vigil.api_alerts import AlertRouteIn
from vigil.errors import NotFound, SpecError
from vigil_common.visibility import sees
from vigil_scheduler import audit
from vigil_scheduler.principals import Principal
from vigil_scheduler.queries import visibility

SECRET_PREFIX = "vgw_"  # a route's signing secret, told apart from a token at a glance
_COLUMNS = "id, name, url, format, owner, team, filter, created_at"
_DELIVERY_COLUMNS = (
    "id, incident_id, job_id, kind, phase, status, attempts, last_error, created_at, updated_at, "
    "CASE WHEN status = 'pending' THEN next_at END AS next_at, delivered_at"
)


def new_secret() -> str:
    """256 random bits: the HMAC key of a `json` route."""
    return SECRET_PREFIX + secrets.token_urlsafe(32)


def _route(row: asyncpg.Record) -> dict[str, Any]:
    found = dict(row)
    found["filter"] = json.loads(found["filter"])
    return found


async def create(conn: asyncpg.Connection, data: AlertRouteIn, by: Principal) -> dict[str, Any]:
    """Store a new route of `by` (of their team with `data.team`: theirs only, unless an admin's); the
    row, with the secret of a `json` route. SpecError naming `team` for a team that is not the caller's."""
    if data.team is not None and not by.admin and data.team != by.team:
        mine = f"your team is {by.team!r}" if by.team else "you are in no team"
        raise SpecError([{"field": "team", "message": f"{data.team!r} is not your team ({mine})"}])
    secret = new_secret() if data.format == "json" else None
    row = await conn.fetchrow(
        f"""INSERT INTO alert_routes (id, name, url, format, owner, team, admin, filter, secret)
            VALUES ($1, $2, $3, $4, $5, $6, $7, $8::jsonb, $9) RETURNING {_COLUMNS}""",
        "r-" + uuid.uuid4().hex[:16],
        data.name,
        data.url,
        data.format,
        by.name,
        data.team,
        by.admin,
        data.filter.model_dump_json(),
        secret,
    )
    detail = {"route": row["id"], "format": data.format, "team": data.team, "made": True}
    await audit.record(conn, "alert_route", by.actor, None, detail=detail)
    return {**_route(row), "secret": secret}


async def list_routes(pool: asyncpg.Pool, viewer: Principal) -> list[dict[str, Any]]:
    """The routes `viewer` sees (their own and their team's; an admin every one), newest first."""
    owner, team = visibility(viewer) or (None, None)
    rows = await pool.fetch(
        f"SELECT {_COLUMNS} FROM alert_routes WHERE {sees(1)} ORDER BY created_at DESC, id", owner, team
    )
    return [_route(r) for r in rows]


async def get(pool: asyncpg.Pool | asyncpg.Connection, route_id: str, viewer: Principal) -> dict[str, Any]:
    """One route `viewer` sees; NotFound otherwise (another team's route is not revealed)."""
    owner, team = visibility(viewer) or (None, None)
    row = await pool.fetchrow(
        f"SELECT {_COLUMNS} FROM alert_routes WHERE id = $3 AND {sees(1)}", owner, team, route_id
    )
    if row is None:
        raise NotFound(f"no alert route {route_id!r}")
    return _route(row)


async def delete(conn: asyncpg.Connection, route_id: str, by: Principal) -> dict[str, Any]:
    """Delete a route `by` sees, with its delivery log (a delivery not yet made is not made)."""
    found = await get(conn, route_id, by)
    await conn.execute("DELETE FROM alert_routes WHERE id = $1", route_id)
    await audit.record(conn, "alert_route", by.actor, None, detail={"route": route_id, "deleted": True})
    return found


async def deliveries(
    pool: asyncpg.Pool, route_id: str, viewer: Principal, limit: int
) -> list[dict[str, Any]]:
    """A route's delivery log, newest first."""
    await get(pool, route_id, viewer)
    rows = await pool.fetch(
        f"SELECT {_DELIVERY_COLUMNS} FROM alert_deliveries WHERE route_id = $1 ORDER BY id DESC LIMIT $2",
        route_id,
        limit,
    )
    return [dict(r) for r in rows]
