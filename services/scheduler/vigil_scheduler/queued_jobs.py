"""The queue's job rows, parsed once while they do not change.

Every placement pass reads the whole queue, and parsing a row (`lifecycle.Job.from_row`: its spec and the
other JSON columns) cost more than the query under a deep queue. `QueuedJobs` keeps the `Job` made from
each row and makes it again only when any of the row's values changed (a new attempt, a spec edited, a
reason noted), so nothing kept can be stale; jobs no longer in the queue are forgotten at each read.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import asyncpg

from vigil_scheduler.lifecycle import Job


class QueuedJobs:
    def __init__(self) -> None:
        self._kept: dict[str, tuple[tuple[Any, ...], Job]] = {}

    def jobs(self, rows: Iterable[asyncpg.Record]) -> dict[str, Job]:
        """The rows' jobs by id, in the rows' order: kept ones where the row is the same, new ones else."""
        kept: dict[str, tuple[tuple[Any, ...], Job]] = {}
        for row in rows:
            values = tuple(row.values())
            found = self._kept.get(row["id"])
            job = found[1] if found is not None and found[0] == values else Job.from_row(row)
            kept[job.id] = (values, job)
        self._kept = kept
        return {job_id: job for job_id, (_, job) in kept.items()}
