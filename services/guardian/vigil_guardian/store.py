"""The guardian's state in Postgres (migrations 0004, 0010, 0012, 0019): job control state, published
incidents, sick devices, and how far in its input each share's state stands; and (migration 0023) the step
from which each runtime change of a job's settings applies, on the scheduler's record of the change. A
guardian loads one share at a time: the jobs whose `subjects.share_of` is that share.

Fencing: whoever takes a share's lock takes the share's next epoch (`take_epoch`), and every `save` of
that share's state checks, in its transaction, that its epoch is still the newest; a holder that lost the
lock (paused past the lease, its connection gone) and runs on is refused (`Fenced`) instead of writing
over its successor's state. The epoch row is read FOR SHARE, so a successor's epoch waits for a save in
flight to commit, and the successor then loads what that save wrote."""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import asyncpg

from vigil.events import IncidentRaised
from vigil_common import subjects

RECENT_INCIDENTS = 100_000
RECENT_FINISHED = 10_000


class Fenced(Exception):
    """A share's state written by a holder that is no longer the newest."""

    def __init__(self, share: int, epoch: int, newest: int | None) -> None:
        super().__init__(f"share {share}: epoch {epoch} is fenced off (the newest is {newest})")
        self.share, self.epoch, self.newest = share, epoch, newest


@dataclass(frozen=True)
class Fence:
    """Whose writes a share's state takes: the holder of `epoch`, while it is the newest."""

    share: int
    epoch: int


async def take_epoch(conn: asyncpg.Connection | asyncpg.Pool, share: int, holder: str) -> Fence:
    """The next epoch of `share`, for the guardian that has just taken its lock (before it loads)."""
    epoch = await conn.fetchval(
        """INSERT INTO guardian_share_epochs (share, epoch, holder) VALUES ($1, 1, $2)
           ON CONFLICT (share) DO UPDATE SET epoch = guardian_share_epochs.epoch + 1,
               holder = EXCLUDED.holder, taken_at = now()
           RETURNING epoch""",
        share,
        holder,
    )
    return Fence(share, int(epoch))


async def check_fence(conn: asyncpg.Connection | asyncpg.Pool, fence: Fence) -> None:
    """Raise `Fenced` unless `fence` holds the share's newest epoch."""
    newest = await conn.fetchval("SELECT epoch FROM guardian_share_epochs WHERE share = $1", fence.share)
    if newest != fence.epoch:
        raise Fenced(fence.share, fence.epoch, newest)


@dataclass
class Saved:
    """What a starting guardian loads."""

    jobs: dict[str, dict[str, Any]] = field(default_factory=dict)
    finished: list[str] = field(default_factory=list)
    incidents: list[str] = field(default_factory=list)
    devices: dict[tuple[str, int], int] = field(default_factory=dict)
    cursor: int | None = None  # the last input-stream sequence whose effect is in this state


async def load(pool: asyncpg.Pool, cursor: str, share: int) -> Saved:
    """The saved state of `share`'s jobs, the device levels, and the share's input `cursor`."""
    saved = Saved(cursor=await pool.fetchval("SELECT seq FROM guardian_cursor WHERE stream = $1", cursor))
    # A job silent for a week (no status, checkpoint or decision) is abandoned, not watched. Rows saved
    # before snapshots carried their share (share IS NULL) are sorted here, and given it.
    active = """SELECT job_id, state, share FROM guardian_jobs
                WHERE NOT terminal AND updated_at > now() - interval '7 days'
                  AND (share = $1 OR share IS NULL)"""
    unsorted = []
    for r in await pool.fetch(active, share):
        if r["share"] is None:
            unsorted.append(r["job_id"])
        if subjects.share_of(r["job_id"]) == share:
            saved.jobs[r["job_id"]] = json.loads(r["state"])
    if unsorted:
        await pool.executemany(
            "UPDATE guardian_jobs SET share = $2 WHERE job_id = $1 AND share IS NULL",
            [(job_id, subjects.share_of(job_id)) for job_id in unsorted],
        )
    saved.finished = [
        r["job_id"]
        for r in await pool.fetch(
            """SELECT job_id FROM guardian_jobs WHERE terminal AND (share = $2 OR share IS NULL)
               ORDER BY updated_at DESC LIMIT $1""",
            RECENT_FINISHED,
            share,
        )
        if subjects.share_of(r["job_id"]) == share
    ][::-1]
    saved.incidents = [
        r["id"]
        for r in await pool.fetch(
            """SELECT id FROM guardian_incidents WHERE job_id = ANY($1::text[])
               ORDER BY created_at DESC LIMIT $2""",
            list(saved.jobs),
            RECENT_INCIDENTS,
        )
    ][::-1]
    for r in await pool.fetch("SELECT node, index, level FROM guardian_devices"):
        saved.devices[(r["node"], r["index"])] = r["level"]
    return saved


async def device_busy(pool: asyncpg.Pool, node: str, index: int) -> bool:
    """True when a job not ended has a rank that has not exited on device `index` of `node`, as the
    guardians (of any share) last saved it."""
    return bool(
        await pool.fetchval(
            """SELECT EXISTS (
                 SELECT 1 FROM guardian_jobs j, jsonb_each(j.state -> 'placement') p
                 WHERE NOT j.terminal AND p.value ->> 0 = $1 AND (p.value ->> 1)::int = $2
                   AND NOT coalesce(j.state -> 'exited', '[]'::jsonb) @> to_jsonb(p.key::int))""",
            node,
            index,
        )
    )


async def save(
    pool: asyncpg.Pool,
    *,
    jobs: Sequence[tuple[str, dict[str, Any], bool]] = (),
    incidents: Sequence[IncidentRaised] = (),
    devices: dict[tuple[str, int], int] | None = None,
    cursor: tuple[str, int] | None = None,
    fence: Fence | None = None,
    applied: Sequence[tuple[str, int, int]] = (),
) -> None:
    """Write job snapshots (job_id, snapshot, terminal), incidents published, device levels, the steps
    settings changes apply from (job_id, revision, step) and the input (stream, sequence) they stand at,
    in one go; with `fence`, only while its epoch is the share's newest (else `Fenced`, and nothing is
    written)."""
    async with pool.acquire() as conn, conn.transaction():
        if fence is not None:  # FOR SHARE: a successor's epoch waits until this commits
            newest = await conn.fetchval(
                "SELECT epoch FROM guardian_share_epochs WHERE share = $1 FOR SHARE", fence.share
            )
            if newest != fence.epoch:
                raise Fenced(fence.share, fence.epoch, newest)
        if cursor is not None:
            await conn.execute(
                """INSERT INTO guardian_cursor (stream, seq) VALUES ($1, $2) ON CONFLICT (stream)
                   DO UPDATE SET seq = GREATEST(guardian_cursor.seq, EXCLUDED.seq), updated_at = now()""",
                *cursor,
            )
        if jobs:
            await conn.executemany(
                """INSERT INTO guardian_jobs (job_id, state, terminal, share, updated_at)
                   VALUES ($1, $2, $3, $4, now())
                   ON CONFLICT (job_id) DO UPDATE SET state = EXCLUDED.state, terminal = EXCLUDED.terminal,
                       share = EXCLUDED.share, updated_at = now()""",
                [
                    (job_id, json.dumps(snap), terminal, subjects.share_of(job_id))
                    for job_id, snap, terminal in jobs
                ],
            )
        if applied:  # the first judged step says it: a later save (a re-feed, a hand-over) keeps it
            await conn.executemany(
                """UPDATE guardian_settings_changes SET from_step = $3, applied_at = now()
                   WHERE job_id = $1 AND revision = $2 AND from_step IS NULL""",
                applied,
            )
        if incidents:
            await conn.executemany(
                """INSERT INTO guardian_incidents (id, job_id, kind, action, step) VALUES ($1, $2, $3, $4, $5)
                   ON CONFLICT (id) DO NOTHING""",
                [(i.event_id, i.job_id, i.kind, i.action, i.step) for i in incidents],
            )
        if devices is not None:
            await conn.execute("DELETE FROM guardian_devices")
            if devices:
                await conn.executemany(
                    "INSERT INTO guardian_devices (node, index, level) VALUES ($1, $2, $3)",
                    [(node, index, level) for (node, index), level in devices.items()],
                )
