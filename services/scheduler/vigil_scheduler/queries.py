"""The read side of the scheduler's tables for the gateway: jobs, nodes and devices as paged dicts.
Steps, checkpoints, incidents and GPU samples come from `vigil_common.readmodel` (telemetry's tables,
which every service's migrations create, so they exist even where telemetry does not run).

Every read of a job takes the principal reading it: a job it may not see (`Principal.sees`) is
answered exactly as one that does not exist."""

from __future__ import annotations

import json
from typing import Any

import asyncpg

from vigil.errors import NotFound
from vigil_common import readmodel
from vigil_common.pages import Page, check_limit, decode_cursor, page
from vigil_common.visibility import sees
from vigil_scheduler import inventory, states
from vigil_scheduler.inventory import ACTIVE_MARK
from vigil_scheduler.lifecycle import JOB_COLUMNS, Job
from vigil_scheduler.placement import spare_nodes
from vigil_scheduler.principals import Principal


async def progress(pool: asyncpg.Pool, job_ids: list[str]) -> dict[str, dict[str, Any]]:
    """Last step and loss per job from telemetry (absent for a job that has made no step)."""
    if not job_ids:
        return {}
    return await readmodel.job_progress(pool, job_ids)


def job_view(job: Job, prog: dict[str, Any] | None = None) -> dict[str, Any]:
    prog = prog or {}
    return {
        "id": job.id,
        "name": job.name,
        "state": job.state,
        "priority": job.priority,
        "attempt": job.attempt,
        "placement": job.placement or [],
        "master_addr": job.master_addr,
        "master_port": job.master_port,
        "resume_from": job.resume_from,
        "last_step": prog.get("last_step"),
        "loss": prog.get("loss"),
        "mfu": prog.get("mfu"),
        "tokens_per_s": prog.get("tokens_per_s"),
        "reason": job.reason,
        "created_at": job.created_at,
        "updated_at": job.updated_at,
        "finished_at": job.finished_at,
        "spec": job.spec,
        "seq": job.seq,
        "owner": job.owner,
        "team": job.team,
        "queue_reason": job.queue_reason,
    }


def visibility(viewer: Principal) -> tuple[str, str | None] | None:
    """The (owner, team) whose jobs `viewer` sees; None: every job (an admin)."""
    return None if viewer.admin else (viewer.name, viewer.team)


class Visible:
    """Whether `viewer` sees a job, remembered per job (a job's owner and team never change): for a
    live stream that passes on events of the jobs its reader may see."""

    def __init__(self, pool: asyncpg.Pool, viewer: Principal, size: int = 10_000) -> None:
        self.pool = pool
        self.viewer = viewer
        self.size = size
        self._known: dict[str, bool] = {}

    async def job(self, job_id: str | None) -> bool:
        if self.viewer.admin:
            return True
        if job_id is None:
            return False
        if (known := self._known.get(job_id)) is not None:
            return known
        row = await self.pool.fetchrow("SELECT owner, team FROM jobs WHERE id = $1", job_id)
        if row is None:
            return False  # not stored yet: asked again next time
        if len(self._known) >= self.size:
            self._known.clear()
        seen = self._known[job_id] = self.viewer.sees(row["owner"], row["team"])
        return seen


async def list_jobs(
    pool: asyncpg.Pool, viewer: Principal, *, state: str | None, limit: int, cursor: str | None
) -> Page:
    """The jobs `viewer` sees, newest first."""
    check_limit(limit)
    key = decode_cursor(cursor, ("bigint",))  # seq
    owner, team = visibility(viewer) or (None, None)
    rows = await pool.fetch(
        f"""SELECT {JOB_COLUMNS} FROM jobs
            WHERE ($1::text IS NULL OR state = $1) AND ($2::bigint IS NULL OR seq < $2) AND {sees(4)}
            ORDER BY seq DESC LIMIT $3""",
        state,
        key[0] if key else None,
        limit + 1,
        owner,
        team,
    )
    jobs = [Job.from_row(r) for r in rows]
    prog = await progress(pool, [j.id for j in jobs[:limit]])
    return page([job_view(j, prog.get(j.id)) for j in jobs], limit, ("seq",))


async def job_detail(pool: asyncpg.Pool, job_id: str, viewer: Principal) -> dict[str, Any]:
    row = await pool.fetchrow(f"SELECT {JOB_COLUMNS} FROM jobs WHERE id = $1", job_id)
    if row is None or not viewer.sees(row["owner"], row["team"]):
        raise NotFound(f"no job {job_id!r}")
    job = Job.from_row(row)
    view = job_view(job, (await progress(pool, [job.id])).get(job.id))
    view["transitions"] = [
        dict(r)
        for r in await pool.fetch(
            """SELECT attempt, from_state, to_state, cause, occurred_at FROM job_transitions
               WHERE job_id = $1 ORDER BY id""",
            job_id,
        )
    ]
    view["attempts"] = await _attempts(pool, job_id, view["transitions"])
    view["ranks"] = [
        dict(r)
        for r in await pool.fetch(
            """SELECT rank, node, started_at, exited_at, exit_code, failure FROM job_ranks
               WHERE job_id = $1 AND attempt = $2 ORDER BY rank""",
            job_id,
            job.attempt,
        )
    ]
    return view


async def _attempts(
    pool: asyncpg.Pool, job_id: str, transitions: list[dict[str, Any]]
) -> list[dict[str, Any]]:
    """Each launched attempt: where it ran, what it resumed from, and why it ended (if it did)."""
    out = []
    for r in await pool.fetch(
        """SELECT attempt, payload, created_at FROM outbox
           WHERE job_id = $1 AND type = 'job.launch' ORDER BY attempt""",
        job_id,
    ):
        launch = json.loads(bytes(r["payload"]))
        after = [t for t in transitions if t["attempt"] > r["attempt"] or states.is_terminal(t["to_state"])]
        out.append(
            {
                "attempt": r["attempt"],
                "launched_at": r["created_at"],
                "placement": launch["placement"],
                "world_size": len(launch["placement"]),
                "resume_from": launch["resume_from"],
                "ended": after[0]["cause"] if after else None,
                "code": (launch["spec"].get("entrypoint") or {}).get("code"),  # the pack it was launched with
            }
        )
    return out


async def require_job(pool: asyncpg.Pool, job_id: str, viewer: Principal) -> None:
    """NotFound unless the job exists and `viewer` sees it (the same answer for both)."""
    row = await pool.fetchrow("SELECT owner, team FROM jobs WHERE id = $1", job_id)
    if row is None or not viewer.sees(row["owner"], row["team"]):
        raise NotFound(f"no job {job_id!r}")


_DEVICE_COLUMNS = f"""d.node, d.index, d.kind, d.name, d.uuid, d.memory_bytes, d.nvlink_peers,
    (d.reported_healthy AND NOT {ACTIVE_MARK}) AS healthy,
    COALESCE(CASE WHEN {ACTIVE_MARK} THEN m.reason END,
             CASE WHEN NOT d.reported_healthy THEN 'reported unhealthy by its worker' END)
        AS unhealthy_reason,
    CASE WHEN {ACTIVE_MARK} THEN m.expires_at END AS mark_expires_at,
    CASE WHEN {ACTIVE_MARK} THEN m.source END AS mark_source,
    d.reported_free, d.present, d.job_id, d.rank"""
_MARKS = "LEFT JOIN device_marks m ON m.node = d.node AND m.index = d.index"


HIDDEN_JOB = "(another user's job)"  # a device's job that the reader may not see


async def _hide_jobs(pool: asyncpg.Pool, viewer: Principal, devices: list[dict[str, Any]]) -> None:
    """Replace the job id of each device (and its latest sample) that runs a job `viewer` may not see:
    the device shows busy, and the job stays unknown."""
    if viewer.admin:
        return
    visible = Visible(pool, viewer)
    for d in devices:
        if d.get("job_id") is not None and not await visible.job(d["job_id"]):
            d["job_id"] = HIDDEN_JOB
        latest = d.get("latest")
        if latest and latest.get("job_id") is not None and not await visible.job(latest["job_id"]):
            d["latest"] = {**latest, "job_id": HIDDEN_JOB}


async def list_nodes(
    pool: asyncpg.Pool, viewer: Principal, *, limit: int, cursor: str | None, spares: int = 0
) -> Page:
    """Nodes by name, their devices, and which are hot spares now (`spares`: `VIGIL_HOT_SPARES`)."""
    check_limit(limit)
    key = decode_cursor(cursor, ("text",))  # name
    rows = await pool.fetch(
        """SELECT name, address, alive, last_heartbeat, started_at, interval_s, lost_at FROM nodes
           WHERE ($1::text IS NULL OR name > $1) ORDER BY name LIMIT $2""",
        key[0] if key else None,
        limit + 1,
    )
    names = [r["name"] for r in rows[:limit]]
    devices: dict[str, list[dict[str, Any]]] = {}
    for d in await pool.fetch(
        f"SELECT {_DEVICE_COLUMNS} FROM devices d {_MARKS}"
        " WHERE d.node = ANY($1::text[]) ORDER BY d.node, d.index",
        names,
    ):
        devices.setdefault(d["node"], []).append(_device(d))
    reserve: frozenset[str] = frozenset()
    if spares:
        async with pool.acquire() as conn:
            reserve = spare_nodes(await inventory.load_inventory(conn), spares)
    items = [{**dict(r), "devices": devices.get(r["name"], []), "spare": r["name"] in reserve} for r in rows]
    await _hide_jobs(pool, viewer, [d for item in items for d in item["devices"]])
    return page(items, limit, ("name",))


async def list_gpus(pool: asyncpg.Pool, viewer: Principal, *, limit: int, cursor: str | None) -> Page:
    check_limit(limit)
    node, index = decode_cursor(cursor, ("text", "int")) or (None, None)
    rows = await pool.fetch(
        f"""SELECT {_DEVICE_COLUMNS}, n.alive FROM devices d JOIN nodes n ON n.name = d.node {_MARKS}
            WHERE ($1::text IS NULL OR (d.node, d.index) > ($1, $2::int))
            ORDER BY d.node, d.index LIMIT $3""",
        node,
        index,
        limit + 1,
    )
    latest = await readmodel.latest_gpu_samples(pool)
    items = [{**_device(r), "alive": r["alive"], "latest": latest.get((r["node"], r["index"]))} for r in rows]
    await _hide_jobs(pool, viewer, items)
    return page(items, limit, ("node", "index"))


def _device(r: asyncpg.Record) -> dict[str, Any]:
    out = dict(r)
    out["nvlink_peers"] = list(out["nvlink_peers"])
    out.pop("alive", None)
    return out
