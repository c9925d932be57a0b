"""What a placement pass knows besides the inventory, read from Postgres: each queued job's request, the
clock (the database's), the running jobs' expected ends (`backfill.Running`), the teams' fair-share
standings (`fairshare`), the quotas and what each job holds (`quotas`); and the queue in words
(`read_queue`, `queueview`). Thin queries; the decisions are `placement.plan`'s, `backfill`'s,
`fairshare`'s and `queueview`'s."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, replace
from typing import Any

import asyncpg

from vigil.spec import Resources, shrink_node_counts
from vigil_common.settings import Settings
from vigil_scheduler import fairshare, inventory, lifecycle, queueview, quotas
from vigil_scheduler.backfill import Backfill, Running
from vigil_scheduler.lifecycle import Job
from vigil_scheduler.placement import PlacementRequest

# Usage older than this many half-lives weighs under a millionth: the usage query leaves it out.
_HALF_LIVES_KEPT = 20


def request_of(job: Job, held: list[dict[str, Any]] | None) -> PlacementRequest:
    """What the job asks of placement at its whole size; `held`: the devices it may have again (its
    previous attempt's, or for a job growing the ones it runs on)."""
    return PlacementRequest(
        job_id=job.id,
        world_size=job.world_size,
        max_nodes=job.max_nodes,
        priority=job.priority,
        seq=job.seq,
        reusable=frozenset((p["node"], p["device"]) for p in held or []),
        owner=job.owner,
        team=job.team,
        shrink_nodes=_shrink_nodes(job.spec),
    )


def _shrink_nodes(spec: dict[str, Any]) -> tuple[int, ...]:
    """The node counts a stored spec lets its job continue on when it loses a node (`PlacementRequest.
    shrink_nodes`); () for a job that is not elastic (most: read without validating the whole spec)."""
    resources = spec.get("resources") or {}
    if not resources.get("elastic"):
        return ()
    return shrink_node_counts(Resources.model_validate(resources), int(spec["train"]["grad_accum"]))


def time_limit(spec: Mapping[str, Any], default_s: float | None) -> float | None:
    """An attempt's time limit in seconds: the spec's `scheduling.time_limit` (stored as seconds), else the
    operator's default (`VIGIL_TIME_LIMIT_DEFAULT_S`); None: no limit."""
    limit = (spec.get("scheduling") or {}).get("time_limit")
    return float(limit) if limit is not None else default_s


@dataclass(frozen=True, slots=True)
class Inputs:
    now: float  # seconds since the epoch, the database's clock at the pass's start
    running: tuple[Running, ...]
    standing: dict[fairshare.Team, fairshare.Standing]
    default_limit_s: float | None

    def request(self, request: PlacementRequest, spec: Mapping[str, Any]) -> PlacementRequest:
        """The job's request with its time limit and its team's fair-share factor."""
        return replace(
            request,
            time_limit=time_limit(spec, self.default_limit_s),
            share_factor=fairshare.factor(self.standing, request.team),
        )

    def backfill(self) -> Backfill:
        return Backfill(now=self.now, running=self.running)


# The strict policy's inputs (VIGIL_QUEUE_POLICY=strict): no clock, no running job's end and no standing, so
# `plan` orders by priority then submission and a blocked head holds up the queue behind it.
STRICT = Inputs(now=0.0, running=(), standing={}, default_limit_s=None)


async def load_inputs(
    conn: asyncpg.Connection,
    settings: Settings,
    waiting_teams: Iterable[str | None],
    *,
    always_share: bool = False,
    cache: fairshare.UsageCache | None = None,
) -> Inputs:
    """The clock, the running jobs and the standings of the teams with usage, a job waiting or a job running.
    While one team alone waits and runs, the fair share decides nothing (no order among teams, nobody
    borrowing): its usage query is skipped (no standings) unless `always_share` (the queue's readers).
    `cache`: the usage read by an earlier pass, reused while it is fresh (`fairshare.UsageCache`)."""
    now = float(await conn.fetchval("SELECT extract(epoch FROM now())"))
    jobs = await running(conn, settings.time_limit_default_s, settings.preemption_grace_s)
    teams = {*waiting_teams, *(team for team, _ in jobs)}
    standing: dict[fairshare.Team, fairshare.Standing] = {}
    if always_share or len(teams) > 1:
        half_life_h = settings.fairshare_half_life_h
        uses = cache.get(now) if cache is not None else None
        if uses is None:
            uses = tuple(await usage(conn, half_life_h))
            if cache is not None:
                cache.put(now, uses)
        hours = fairshare.decayed_gpu_hours(uses, now, half_life_h)
        standing = fairshare.standings(await shares(conn), hours, teams)
    return Inputs(now, tuple(r for _, r in jobs), standing, settings.time_limit_default_s)


async def running(
    conn: asyncpg.Connection, default_limit_s: float | None, grace_s: float
) -> list[tuple[str | None, Running]]:
    """Every job holding devices, with its team: its devices and its expected end (its attempt's start plus
    its time limit; None without a limit). The start is its first rank's, from which the limit is enforced
    (`time_limits.overdue`); before any rank started, its placement's. An attempt being stopped (preempted,
    or at its limit: `job_stops`) ends at the latest `grace_s` after its stop was asked for."""
    rows = await conn.fetch(
        """SELECT j.id, j.team, (j.spec->'scheduling'->>'time_limit')::float8 AS time_limit,
                  array_agg(d.node) AS nodes, array_agg(d.index) AS indices,
                  extract(epoch FROM coalesce(
                      (SELECT min(r.started_at) FROM job_ranks r
                        WHERE r.job_id = j.id AND r.attempt = j.attempt),
                      (SELECT max(t.occurred_at) FROM job_transitions t
                        WHERE t.job_id = j.id AND t.attempt = j.attempt AND t.to_state = 'SCHEDULED')
                  )) AS started,
                  (SELECT extract(epoch FROM max(s.requested_at)) FROM job_stops s
                    WHERE s.job_id = j.id AND s.attempt = max(d.attempt)) AS stopping
           FROM devices d JOIN jobs j ON j.id = d.job_id
           GROUP BY j.id, j.team, j.spec, j.attempt"""
    )
    out = []
    for r in rows:  # the spec's time limit read in the query: no spec parsed for each running job each pass
        limit = r["time_limit"] if r["time_limit"] is not None else default_limit_s
        ends = None if limit is None or r["started"] is None else float(r["started"]) + limit
        if r["stopping"] is not None:
            stopped = float(r["stopping"]) + grace_s
            ends = stopped if ends is None else min(ends, stopped)
        devices = frozenset(zip(r["nodes"], r["indices"], strict=True))
        out.append((r["team"], Running(r["id"], devices, ends)))
    return out


async def usage(conn: asyncpg.Connection, half_life_h: float) -> list[fairshare.Use]:
    """The attempts that held devices within the decay's reach: each one's team, devices (its ranks), and
    from its first rank's start to its last rank's exit (infinite for a running attempt, which
    `fairshare.decayed_gpu_hours` counts up to its `now`; the attempt's last transition where a rank's exit
    was never heard)."""
    rows = await conn.fetch(
        """SELECT j.team, count(*) AS devices, extract(epoch FROM min(r.started_at)) AS start,
                  extract(epoch FROM CASE
                      WHEN NOT bool_or(r.exited_at IS NULL) THEN max(r.exited_at)
                      WHEN r.attempt = j.attempt AND j.finished_at IS NULL THEN 'infinity'::timestamptz
                      ELSE (SELECT max(t.occurred_at) FROM job_transitions t
                             WHERE t.job_id = j.id AND t.attempt = r.attempt) END) AS stop
           FROM job_ranks r JOIN jobs j ON j.id = r.job_id
           WHERE r.started_at IS NOT NULL
             AND (j.finished_at IS NULL OR j.finished_at > now() - make_interval(secs => $1))
           GROUP BY j.id, j.team, j.attempt, j.finished_at, r.attempt""",
        half_life_h * 3600.0 * _HALF_LIVES_KEPT,
    )
    return [fairshare.Use(r["team"], r["devices"], float(r["start"]), float(r["stop"])) for r in rows]


async def shares(conn: asyncpg.Connection | asyncpg.Pool) -> dict[str, float]:
    """Every team's fair-share weight (migration 0022; 1 unless set)."""
    return {r["name"]: r["share"] for r in await conn.fetch("SELECT name, share FROM teams")}


async def quotas_of(conn: asyncpg.Connection | asyncpg.Pool) -> quotas.Quotas:
    """The GPU quotas of every user and team that has one."""
    rows = await conn.fetch(
        "SELECT 'user' AS kind, name, gpus FROM users WHERE gpus IS NOT NULL"
        " UNION ALL SELECT 'team', name, gpus FROM teams WHERE gpus IS NOT NULL"
    )
    return quotas.Quotas(
        users={r["name"]: r["gpus"] for r in rows if r["kind"] == "user"},
        teams={r["name"]: r["gpus"] for r in rows if r["kind"] == "team"},
    )


async def holdings(conn: asyncpg.Connection) -> list[quotas.Holding]:
    """The devices each job holds now, with its owner and team (what quotas count)."""
    rows = await conn.fetch(
        """SELECT j.id, j.owner, j.team, count(*) AS devices FROM devices d JOIN jobs j ON j.id = d.job_id
           GROUP BY j.id, j.owner, j.team"""
    )
    return [quotas.Holding(r["id"], r["owner"], r["team"], r["devices"]) for r in rows]


@dataclass(frozen=True, slots=True)
class QueueView:
    """The queue as `read_queue` found it: its entries (`queueview.Entry`) and the jobs they are of."""

    now: float
    entries: list[queueview.Entry]
    jobs: dict[str, Job]
    standing: dict[fairshare.Team, fairshare.Standing]


async def read_queue(pool: asyncpg.Pool, settings: Settings, sees: Callable[[Job], bool]) -> QueueView:
    """Every queued job `sees` allows, with its position in the whole queue, why it waits and when it should
    start (`queueview.explain`, the placement pass's own decision over a snapshot); a reason names a job
    `sees` refuses as "another user's job"."""
    async with pool.acquire() as conn, conn.transaction(isolation="repeatable_read", readonly=True):
        rows = await conn.fetch(
            f"SELECT {lifecycle.JOB_COLUMNS} FROM jobs WHERE queued ORDER BY priority DESC, seq"
        )
        jobs = {job.id: job for job in map(Job.from_row, rows)}
        snapshot = await inventory.load_inventory(conn)
        facts = await load_inputs(conn, settings, (job.team for job in jobs.values()), always_share=True)
        ledger = quotas.Ledger(await quotas_of(conn), await holdings(conn))
    requests = [facts.request(request_of(job, job.previous_placement), job.spec) for job in jobs.values()]
    visible = {job_id for job_id, job in jobs.items() if sees(job)}
    entries = queueview.explain(
        requests,
        snapshot,
        facts.now,
        facts.running,
        ledger=ledger,
        standing=facts.standing,
        spares=settings.hot_spares,
        name=lambda job_id: job_id if job_id in visible else "another user's job",
    )
    return QueueView(facts.now, [e for e in entries if e.job_id in visible], jobs, facts.standing)
