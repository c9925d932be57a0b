"""Code packages on the control plane's side: an upload checked and kept by its SHA-256 (`subjects.CODE`, a
NATS Object Store bucket; the same bytes once), who may use and read which pack, and the sweep of packs no
job runs.

A user may name a pack in a spec (`entrypoint.code`) and download it when they uploaded it, their team did,
or it is the pack of a job they see (`visibility`); an admin, any pack. To anyone else a pack does not
exist. A pack is kept while a job that references it is kept (jobs are never deleted); a pack uploaded and
never submitted is deleted after `UNREFERENCED_GRACE_S`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from dataclasses import dataclass

import asyncpg

from vigil import codepack
from vigil.errors import NotFound, RetryableError, SpecError
from vigil.spec import JobSpec
from vigil_common import subjects, visibility
from vigil_common.bus import Bus
from vigil_common.settings import Settings
from vigil_scheduler.principals import Principal

log = logging.getLogger("vigil.scheduler")

UNREFERENCED_GRACE_S = 24 * 3600.0  # an upload's time to be submitted before the sweep deletes it
SWEEP_EVERY_S = 3600.0
RUNS = "(spec -> 'entrypoint' ->> 'code')"  # the pack a job row runs (indexed: migration 0024)


@dataclass(frozen=True)
class Uploaded:
    sha256: str
    bytes: int
    entries: int
    stored: bool  # False: the bucket held these bytes already


async def upload(pool: asyncpg.Pool, bus: Bus, settings: Settings, data: bytes, by: Principal) -> Uploaded:
    """`data` checked (PackRefused, a 422 naming the entry), kept in the bucket by its hash, and recorded
    as `by`'s (and their team's)."""
    pack = await asyncio.to_thread(codepack.check, data, max_mb=settings.code_max_mb)
    # recorded first: a sweep that deletes the same bytes meanwhile holds this row's lock until it is done
    # (then this upload puts them again), and one after it sees the upload as new
    await pool.execute(
        "INSERT INTO code_uploads (sha256, owner, team, bytes) VALUES ($1, $2, $3, $4)"
        " ON CONFLICT (sha256, owner) DO UPDATE SET team = EXCLUDED.team, uploaded_at = now()",
        pack.sha256,
        by.name,
        by.team,
        len(data),
    )
    stored = await bus.put_object(subjects.CODE, pack.sha256, data, replicas=settings.stream_replicas)
    known = "" if stored else " (kept already)"
    log.info("code package %s, %d bytes, from %s%s", pack.sha256, len(data), by.actor, known)
    return Uploaded(pack.sha256, len(data), pack.entries, stored)


async def may_read(conn: asyncpg.Connection | asyncpg.Pool, sha256: str, by: Principal) -> bool:
    """Whether `by` may run or read the pack `sha256` (see the module's docstring)."""
    # FOR SHARE: in a submit's transaction, the sweep cannot delete the pack until the job is stored
    return bool(
        await conn.fetchval(
            "SELECT EXISTS (SELECT 1 FROM code_uploads WHERE sha256 = $1"
            "   AND ($2::text IS NULL OR owner = $2 OR (team IS NOT NULL AND team = $3::text)) FOR SHARE)"
            f" OR EXISTS (SELECT 1 FROM jobs WHERE {RUNS} = $1 AND {visibility.sees(2)})",
            sha256,
            None if by.admin else by.name,
            by.team,
        )
    )


async def check_use(conn: asyncpg.Connection | asyncpg.Pool, spec: JobSpec, by: Principal) -> None:
    """SpecError naming `entrypoint.code` when `spec` names a pack `by` may not run (or none uploaded)."""
    code = spec.entrypoint.code if spec.entrypoint is not None else None
    if code is not None and not await may_read(conn, code, by):
        message = f"no code package {code} of yours or your team's: upload it first (vigil submit --code DIR)"
        raise SpecError([{"field": "entrypoint.code", "message": message}])


async def of_job(pool: asyncpg.Pool, bus: Bus, job_id: str, by: Principal) -> tuple[str, bytes]:
    """The hash and bytes of the pack job `job_id` runs: NotFound for a job `by` does not see, or one
    that runs no pack."""
    row = await pool.fetchrow(
        f"SELECT {RUNS} AS code FROM jobs WHERE id = $1 AND {visibility.sees(2)}",
        job_id,
        None if by.admin else by.name,
        by.team,
    )
    if row is None:
        raise NotFound(f"no job {job_id!r}")
    if row["code"] is None:
        raise NotFound(f"job {job_id} runs no code package (it was not submitted with --code)")
    return row["code"], await bus.get_object(subjects.CODE, row["code"])


async def sweep(
    pool: asyncpg.Pool, bus: Bus, settings: Settings, grace_s: float = UNREFERENCED_GRACE_S
) -> list[str]:
    """Delete the packs uploaded more than `grace_s` ago that no job references; the hashes deleted."""
    gone = await pool.fetch(
        "SELECT sha256 FROM code_uploads u GROUP BY sha256"
        " HAVING max(uploaded_at) < now() - make_interval(secs => $1)"
        f"   AND NOT EXISTS (SELECT 1 FROM jobs WHERE {RUNS} = u.sha256)",
        grace_s,
    )
    deleted = []
    for row in gone:
        sha = row["sha256"]
        async with pool.acquire() as conn, conn.transaction():
            # its rows locked first: a submit naming it (FOR SHARE, `may_read`) or an upload of it finishes,
            # then the questions are asked again, each statement seeing what they stored
            await conn.execute("SELECT 1 FROM code_uploads WHERE sha256 = $1 FOR UPDATE", sha)
            if not await _unused(conn, sha, grace_s):
                continue
            await conn.execute("DELETE FROM code_uploads WHERE sha256 = $1", sha)
            await bus.delete_object(subjects.CODE, sha, replicas=settings.stream_replicas)
        deleted.append(sha)
    if deleted:
        log.info("deleted %d code package(s) no job runs", len(deleted))
    return deleted


async def _unused(conn: asyncpg.Connection, sha256: str, grace_s: float) -> bool:
    """No job runs the pack, and nobody uploaded it within `grace_s`."""
    recent = await conn.fetchval(
        "SELECT max(uploaded_at) >= now() - make_interval(secs => $2) FROM code_uploads WHERE sha256 = $1",
        sha256,
        grace_s,
    )
    if recent is not False:  # True, or None: no upload row any more
        return False
    return not await conn.fetchval(f"SELECT EXISTS (SELECT 1 FROM jobs WHERE {RUNS} = $1)", sha256)


async def sweep_loop(pool: asyncpg.Pool, bus: Bus, settings: Settings, stop: asyncio.Event) -> None:
    """`sweep` every SWEEP_EVERY_S until `stop`; a failed sweep is logged and tried again next time."""
    while not stop.is_set():
        try:
            await sweep(pool, bus, settings)
        except (RetryableError, OSError, asyncpg.PostgresError) as exc:
            log.warning("sweeping code packages: %s", exc)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), SWEEP_EVERY_S)
