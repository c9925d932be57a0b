"""The job page's one document: everything the page shows below its title (header, curves, marks,
attempts, checkpoints, incidents), read together and stamped with the version it is at least as new
as, so the page renders all of it from one answer and refetches it on `live.job_changes`."""

from __future__ import annotations

import asyncio
from typing import Any

import asyncpg

from vigil_common import readmodel
from vigil_scheduler import guardian_settings, queries
from vigil_scheduler.console import views
from vigil_scheduler.principals import Principal

LIMIT = 1000  # incidents and checkpoints shown: a page is enough for a console view


async def job_document(
    pool: asyncpg.Pool, job_id: str, viewer: Principal, points: int = views.DEFAULT_POINTS
) -> dict[str, Any]:
    # The version first: whatever is read after it is at least as new, so when something changes while
    # this reads, the next version differs and the page comes back for it.
    await queries.require_job(pool, job_id, viewer)  # another user's job: 404, before anything is read
    version = await readmodel.job_version(pool, job_id)
    job = await queries.job_detail(pool, job_id, viewer)  # NotFound: 404
    resources = job["spec"]["resources"]
    ranks = int(resources["nodes"]) * int(resources["gpus_per_node"])
    bucket = views.bucket_width(int(job["spec"]["train"]["steps"]), points, ranks)
    rows, abandoned, marks, settings, incidents, checkpoints = await asyncio.gather(
        readmodel.step_buckets(pool, job_id, bucket=bucket),
        readmodel.abandoned_buckets(pool, job_id, bucket=bucket),
        readmodel.step_marks(pool, job_id),
        guardian_settings.changes_of(pool, job_id),
        readmodel.incidents(pool, job_id=job_id, limit=LIMIT),
        readmodel.checkpoints(pool, job_id, limit=LIMIT),
    )
    return {
        "version": version,
        "job": views.job_header(job),
        "attempts": views.attempt_rows(job),
        "series": views.series(rows, bucket, abandoned),
        # halts, rollbacks, attempt starts, guardian settings changes (from the step judged under each);
        # incidents are marked from "incidents"
        "marks": {**marks, "settings": settings},
        "incidents": views.incident_rows(incidents["items"]),
        "checkpoints": views.checkpoint_rows(checkpoints["items"]),
    }
