"""The outbox of alert deliveries: a row per route that wants an incident, written in the transaction
that acknowledges the incident (`enqueue`), and a `resolved` row per firing alertmanager delivery when
its job runs again or succeeds (`resolve`, in the status consumer's transaction). `delivery` posts them.

A route hears only the incidents of jobs its owner sees: `vigil_common.visibility.sees`, asked with the
route's owner and its team (a user's own route: the owner's team now)."""

from __future__ import annotations

from collections.abc import Sequence

import asyncpg

from vigil.events import IncidentRaised, JobStateChanged, Message
from vigil.jobstates import JobState
from vigil_common.visibility import sees
from vigil_telemetry.alerts import formats
from vigil_telemetry.alerts.match import Route, wanted

# A job that runs again after an incident (a rollback, a restart) or succeeds has recovered from it.
RECOVERED = frozenset({JobState.RUNNING, JobState.SUCCEEDED})

_INSERT = """INSERT INTO alert_deliveries (route_id, incident_id, job_id, kind, occurred_at, phase, url, body)
             VALUES ($1, $2, $3, $4, $5, $6, $7, $8) ON CONFLICT (route_id, incident_id, phase) DO NOTHING"""


async def routes(conn: asyncpg.Connection) -> list[Route]:
    rows = await conn.fetch(
        """SELECT r.id, r.url, r.format, r.owner, r.team, r.admin, r.filter, u.team AS owner_team
           FROM alert_routes r LEFT JOIN users u ON u.name = r.owner"""
    )
    return [Route.from_row(r) for r in rows]


async def _sees(conn: asyncpg.Connection, route: Route, job_id: str | None) -> bool:
    if route.admin:
        return True
    if job_id is None:  # an incident of no job (a node's): an admin's routes only
        return False
    found = await conn.fetchval(
        f"SELECT true FROM jobs WHERE id = $3 AND {sees(1)}", route.owner, route.viewer_team, job_id
    )
    return bool(found)


async def enqueue(conn: asyncpg.Connection, incidents: Sequence[IncidentRaised], console_url: str) -> int:
    """Write the deliveries `incidents` owe (in the caller's transaction); how many rows were new. An
    incident seen again (a redelivery) adds nothing."""
    if not incidents:
        return 0
    every = await routes(conn)
    if not every:
        return 0
    added = 0
    for incident in incidents:
        team = None
        if incident.job_id:
            team = await conn.fetchval("SELECT team FROM jobs WHERE id = $1", incident.job_id)
        ctx = formats.Context(team=team, console_url=console_url)
        for route in every:
            if not wanted(route.filter, incident, team) or not await _sees(conn, route, incident.job_id):
                continue
            status = await conn.execute(
                _INSERT,
                route.id,
                incident.event_id,
                incident.job_id,
                incident.kind,
                incident.occurred_at,
                "firing",
                formats.target(route.format, route.url),
                formats.body(route.format, incident, ctx),
            )
            added += status.endswith(" 1")
    return added


async def resolve(conn: asyncpg.Connection, events: Sequence[Message]) -> int:
    """For each job in `events` that changed to RUNNING or SUCCEEDED: a `resolved` delivery for each of
    its alertmanager alerts fired before the change and not yet resolved. How many rows were new."""
    added = 0
    for event in events:
        if not isinstance(event, JobStateChanged) or event.to_state not in RECOVERED or not event.job_id:
            continue
        firing = await conn.fetch(
            """SELECT f.route_id, f.incident_id, f.job_id, f.kind, f.occurred_at, f.url, f.body
               FROM alert_deliveries f JOIN alert_routes r ON r.id = f.route_id
               WHERE f.job_id = $1 AND f.phase = 'firing' AND r.format = 'alertmanager'
                 AND f.occurred_at < $2
                 AND NOT EXISTS (SELECT 1 FROM alert_deliveries d WHERE d.route_id = f.route_id
                                 AND d.incident_id = f.incident_id AND d.phase = 'resolved')""",
            event.job_id,
            event.occurred_at,
        )
        for f in firing:
            status = await conn.execute(
                _INSERT,
                f["route_id"],
                f["incident_id"],
                f["job_id"],
                f["kind"],
                f["occurred_at"],
                "resolved",
                f["url"],
                formats.resolved(f["body"], event.occurred_at),
            )
            added += status.endswith(" 1")
    return added
