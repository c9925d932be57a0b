"""A job's guardian settings changed while it runs (`PATCH /api/v1/jobs/{id}/guardian`,
`vigil guardian set`).

One transaction, under the job's row lock: the job's spec takes the new `guardian:` section (so every later
launch carries it), a `guardian_settings_changes` row (migration 0023) and an audit record are written, and
a `GuardianSettingsChanged` goes into the outbox for `status(job, CONTROL)`. That subject is part of
VIGIL_JOBS, the stream each guardian share judges in order: the guardian that judges the job (after a
restart or a hand-over too) applies the change from the first step stored after it, and fills in that
step on the row (`vigil_guardian.store.save`).

The change is validated as a submitted spec's guardian section is (`vigil.spec.parse_spec` on the spec with
the section changed): an unknown field or a bad value is a `SpecError` naming `guardian.<field>`.
"""

from __future__ import annotations

import json
from typing import Any

import asyncpg

from vigil.errors import Conflict, NotFound, SpecError
from vigil.events import GuardianSettingsChanged
from vigil.spec import GuardianSpec, parse_spec
from vigil_common import subjects
from vigil_scheduler import audit, lifecycle, outbox
from vigil_scheduler.principals import Principal

SECTION = "guardian"


def changed_section(spec: dict[str, Any], changes: dict[str, Any]) -> GuardianSpec:
    """The job's guardian section with `changes` applied, validated with the rest of its spec; a
    `SpecError` naming each bad field (`guardian.spike_zscore`) when it does not validate."""
    if not changes:
        raise SpecError([{"field": SECTION, "message": "name at least one field to change (field=value)"}])
    section = {**(spec.get(SECTION) or {}), **changes}
    return parse_spec({**spec, SECTION: section}).guardian


async def change(
    conn: asyncpg.Connection, job_id: str, changes: dict[str, Any], by: Principal
) -> dict[str, Any]:
    """Apply `changes` to the guardian settings of a job `by` may see, inside the caller's transaction
    (whose commit must wake the outbox relay); the change's record. NotFound for a job `by` may not see
    (as for one that does not exist), Conflict for a job that has ended."""
    job = await lifecycle.lock_job(conn, job_id)
    if job is None or not by.sees(job.owner, job.team):
        raise NotFound(f"no job {job_id!r}")
    if job.terminal:
        raise Conflict(f"job {job_id} is already {job.state}; only a queued or running job's settings change")
    settings = changed_section(job.spec, changes)
    revision = await conn.fetchval(
        "SELECT coalesce(max(revision), 0) + 1 FROM guardian_settings_changes WHERE job_id = $1", job.id
    )
    event = GuardianSettingsChanged(
        job_id=job.id,
        attempt=job.attempt,
        revision=revision,
        settings=settings,
        changed={k: getattr(settings, k) for k in changes},
        by=by.actor,
    )
    section = settings.model_dump_json()
    await conn.execute(
        "UPDATE jobs SET spec = jsonb_set(spec, '{guardian}', $2::jsonb), updated_at = now() WHERE id = $1",
        job.id,
        section,
    )
    row = await conn.fetchrow(
        """INSERT INTO guardian_settings_changes (job_id, revision, event_id, actor, changed, settings)
           VALUES ($1, $2, $3, $4, $5::jsonb, $6::jsonb) RETURNING changed_at""",
        job.id,
        revision,
        event.event_id,
        by.actor,
        json.dumps(event.changed),
        section,
    )
    detail = {"revision": revision, "changed": event.changed}
    eid = event.event_id
    await audit.record(conn, "guardian", by.actor, job.id, job.attempt, event_id=eid, detail=detail)
    await outbox.enqueue(conn, subjects.status(job.id, subjects.CONTROL), event)
    return {
        "job_id": job.id,
        "revision": revision,
        "changed": event.changed,
        "settings": settings.model_dump(mode="json"),
        "by": by.actor,
        "changed_at": row["changed_at"],
        "from_step": None,
    }


async def changes_of(pool: asyncpg.Pool | asyncpg.Connection, job_id: str) -> list[dict[str, Any]]:
    """The job's settings changes, oldest first, each with the step it applied from (None: not judged
    yet): what the console marks on the job's curves."""
    rows = await pool.fetch(
        """SELECT revision, changed, actor, changed_at, from_step FROM guardian_settings_changes
           WHERE job_id = $1 ORDER BY revision""",
        job_id,
    )
    return [{**dict(r), "changed": json.loads(r["changed"])} for r in rows]
