"""The scheduler's core: submit and cancel, the placement pass, node-lost detection, and the
transaction helper every change goes through (commit, then wake the outbox relay)."""

from __future__ import annotations

import asyncio
import contextvars
import logging
import random
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from datetime import datetime
from typing import Any

import asyncpg
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider

from vigil.errors import Conflict, NotFound, SpecError
from vigil.events import IncidentRaised, LaunchJob, RankPlacement
from vigil.jobstates import TERMINAL_STATES, JobState
from vigil.spec import JobSpec, Resources, grad_accum_at
from vigil_common import subjects, tracing
from vigil_common.bus import Presence
from vigil_common.service import wait_any
from vigil_common.settings import Settings
from vigil_scheduler import (
    admission,
    audit,
    code_packs,
    fairshare,
    inventory,
    lifecycle,
    outbox,
    quotas,
    recovery,
    states,
)
from vigil_scheduler import idempotency as idempotency_keys
from vigil_scheduler.lifecycle import Job
from vigil_scheduler.outbox import Relay
from vigil_scheduler.pacing import Pacing
from vigil_scheduler.placement import Placement, grow, plan
from vigil_scheduler.preempting import preempt_for
from vigil_scheduler.principals import Principal
from vigil_scheduler.queued_jobs import QueuedJobs
from vigil_scheduler.schedule_inputs import STRICT, holdings, load_inputs, quotas_of, request_of

log = logging.getLogger(__name__)
# A placement pass asked for inside `Scheduler.tx` waits for the commit (the list records the ask).
_PLACEMENT_ASKED: contextvars.ContextVar[list[bool] | None] = contextvars.ContextVar(
    "placement_asked", default=None
)

_SCHEDULE_LOCK = 0x76736368  # "vsch": one placement pass at a time, across schedulers
# Rendezvous ports: below Linux's default ephemeral range (32768-60999), from which every outgoing
# connection takes its local port: a port there may be taken by a connection when rank 0 binds it.
MASTER_PORTS = range(29500, 32768)
PRESENCE_AGAIN_S = 0.2  # a node's worker found gone is asked once more, this much later


def new_job_id() -> str:
    return "j-" + uuid.uuid4().hex[:12]


class Scheduler:
    def __init__(
        self,
        settings: Settings,
        pool: asyncpg.Pool,
        relay: Relay,
        provider: TracerProvider | None = None,
        presence: Callable[[str], Awaitable[Presence]] | None = None,
    ) -> None:
        self.settings = settings
        self.pool = pool
        self.relay = relay
        self.presence = presence  # is a node's worker still connected? (`Bus.presence` of its ping)
        self.tracer = tracing.tracer(provider, "vigil.scheduler")
        self._placement_wanted = asyncio.Event()
        self._usage = fairshare.UsageCache()  # the teams' usage, read by one pass, reused by the next few
        self._queued = QueuedJobs()
        self._rng = random.Random()
        self.started_at: datetime | None = None
        self.active = False  # this process holds the scheduling lock (`vigil_common.lease`)

    @asynccontextmanager
    async def tx(self) -> AsyncIterator[asyncpg.Connection]:
        """One transaction; after it commits, the outbox relay is woken to publish what it added, and a
        placement pass asked for inside it runs (before the commit, the pass would not see the change)."""
        asked: list[bool] = []
        token = _PLACEMENT_ASKED.set(asked)
        try:
            async with self.pool.acquire() as conn, conn.transaction():
                yield conn
        finally:
            _PLACEMENT_ASKED.reset(token)
        self.relay.wake()
        if asked:
            self._placement_wanted.set()

    def want_placement(self) -> None:
        """Ask for a placement pass: now, or inside a transaction (`tx`), once it has committed."""
        if (asked := _PLACEMENT_ASKED.get()) is not None:
            asked.append(True)
        else:
            self._placement_wanted.set()

    # --- the API's operations ----------------------------------------------------------------------

    async def submit(
        self,
        spec: JobSpec,
        by: Principal,
        parent: dict[str, str] | None = None,
        idempotency: tuple[str, str] | None = None,
    ) -> tuple[Job, bool]:
        """Store the job PENDING, owned by `by` and its team (and who asked, in the audit record); the
        submit span's context is kept so schedule and launch join its trace. SpecError when this cluster
        would not run it (`admission`), or when it needs more GPUs than its owner's or team's quota.

        `idempotency`: (key, body digest) of an `Idempotency-Key` submit: a key used before returns the
        job made then. The job, and whether it was made now."""
        admission.check(spec, self.settings)
        if why := quotas.alone_exceeds(by.name, by.team, spec.resources.world_size, await self.load_quotas()):
            raise SpecError([{"field": "resources", "message": why}])
        with self.tracer.start_as_current_span(
            "submit job", context=tracing.extract(parent), kind=trace.SpanKind.SERVER
        ) as span:
            job_id = new_job_id()
            async with self.tx() as conn:
                await code_packs.check_use(conn, spec, by)  # a code package of theirs or their team's
                if idempotency is not None:
                    earlier = await idempotency_keys.claim(conn, by.actor, *idempotency, job_id)
                    if earlier is not None:
                        span.set_attribute("vigil.job_id", earlier)
                        job = await lifecycle.get_job(conn, earlier)
                        assert job is not None  # the key's row goes with its job
                        return job, False
                span.set_attribute("vigil.job_id", job_id)
                job = await lifecycle.insert_job(
                    conn, job_id, spec, tracing.inject({}), owner=by.name, team=by.team
                )
                await audit.record(conn, "submit", by.actor, job.id, job.attempt, detail={"name": spec.name})
        self.want_placement()
        return job, True

    async def cancel(self, job_id: str, by: Principal, reason: str = "by request") -> Job:
        """Cancel a job `by` may see (another user's job is a NotFound, as one that does not exist)."""
        async with self.tx() as conn:
            job = await lifecycle.lock_job(conn, job_id)
            if job is None or not by.sees(job.owner, job.team):
                raise NotFound(f"no job {job_id!r}")
            if job.terminal:
                raise Conflict(
                    f"job {job_id} is already {job.state}; only a running or queued job can be cancelled"
                )
            await audit.record(conn, "cancel", by.actor, job.id, job.attempt, detail={"reason": reason})
            job = await lifecycle.cancel(conn, job, reason)
        self.want_placement()
        return job

    async def clear_device_mark(self, node: str, index: int, actor: str) -> dict[str, Any]:
        """An operator's clearing of a device's unhealthy mark, audited; NotFound when it has none."""
        async with self.tx() as conn:
            mark = await inventory.clear_mark(conn, node, index)
            if mark is None:
                raise NotFound(f"device {node}:{index} has no unhealthy mark to clear")
            detail = {"node": node, "index": index, **{k: _plain(v) for k, v in mark.items()}}
            await audit.record(conn, "clear_device_mark", actor, None, detail=detail)
        log.warning("device %s:%d: mark cleared by %s (%s)", node, index, actor, mark["reason"])
        self.want_placement()
        return {"node": node, "index": index, "cleared": detail}

    async def load_quotas(self, conn: asyncpg.Connection | asyncpg.Pool | None = None) -> quotas.Quotas:
        """The GPU quotas of every user and team that has one."""
        return await quotas_of(conn or self.pool)

    # --- placement -----------------------------------------------------------------------------------

    async def schedule_pass(self) -> list[Placement]:
        """Place queued jobs in priority, fair-share, then submission order, with EASY backfill behind a
        blocked head (`placement.plan`); launch each placed one (via the outbox)."""
        async with self.tx() as conn:
            await lock_placement(conn)
            rows = await conn.fetch(
                f"SELECT {lifecycle.JOB_COLUMNS} FROM jobs WHERE queued"
                " ORDER BY priority DESC, seq FOR UPDATE"
            )
            if not rows:
                return []
            jobs = self._queued.jobs(rows)  # each row parsed once while it does not change
            snapshot = await inventory.load_inventory(conn)
            strict = self.settings.queue_policy == "strict"  # priority then submission, nothing else
            teams = (j.team for j in jobs.values())
            facts = STRICT if strict else await load_inputs(conn, self.settings, teams, cache=self._usage)
            requests = [
                facts.request(request_of(job, job.previous_placement), job.spec) for job in jobs.values()
            ]
            ledger = quotas.Ledger(await self.load_quotas(conn), await holdings(conn))
            backfill = facts.backfill()  # out: backfill.reservation, the blocked head job (or None)
            spares = self.settings.hot_spares
            placed, after = plan(requests, snapshot, ledger, spares=spares, backfill=backfill)
            await _note_waiting(conn, jobs, ledger.waiting)
            for placement in placed:
                node = snapshot.node(placement.ranks[0].node)
                assert node is not None
                await self._launch(conn, jobs[placement.job_id], placement, node.address)
            # the blocked job of highest priority stops the victims that make room for it, teams over their
            # share first (`preempting`): they exit, and a later pass places it first
            over = {team for team, standing in facts.standing.items() if standing.over_share}
            if not strict:
                await preempt_for(
                    conn, self.settings, requests, placed, after, ledger.waiting, over.__contains__
                )
            return placed

    async def whole_size_fits(self, conn: asyncpg.Connection, job: Job) -> Placement | None:
        """Would the queue place `job`, running shrunk, at its whole size now (`placement.grow`): on the
        devices it holds and the free capacity, in queue order among the queued jobs, under the quotas? In
        the caller's transaction, which holds the placement lock (`lock_placement`)."""
        rows = await conn.fetch(
            f"SELECT {lifecycle.JOB_COLUMNS} FROM jobs WHERE queued AND id <> $1 ORDER BY priority DESC, seq",
            job.id,
        )
        queue = [request_of(queued, queued.previous_placement) for queued in map(Job.from_row, rows)]
        snapshot = await inventory.load_inventory(conn)
        ledger = quotas.Ledger(await self.load_quotas(conn), await holdings(conn))
        return grow(request_of(job, job.placement), queue, snapshot, ledger, spares=self.settings.hot_spares)

    async def _launch(
        self, conn: asyncpg.Connection, job: Job, placement: Placement, master_addr: str
    ) -> None:
        with self.tracer.start_as_current_span(
            "schedule job", context=tracing.extract(job.trace_context), attributes={"vigil.job_id": job.id}
        ):
            claimed = await conn.execute(
                """UPDATE devices d SET job_id = $1, attempt = $2, rank = p.rank
                   FROM unnest($3::text[], $4::int[], $5::int[]) AS p(node, index, rank)
                   WHERE d.node = p.node AND d.index = p.index AND (d.job_id IS NULL OR d.job_id = $1)""",
                job.id,
                job.attempt,
                [r.node for r in placement.ranks],
                [r.device for r in placement.ranks],
                [r.rank for r in placement.ranks],
            )
            if claimed != f"UPDATE {len(placement.ranks)}":
                raise Conflict(f"job {job.id}: a device of its placement was taken meanwhile ({claimed})")
            port = await self._master_port(conn, job, master_addr)
            ranks = [
                RankPlacement(rank=r.rank, node=r.node, device=r.device, local_rank=r.local_rank)
                for r in placement.ranks
            ]
            skip = (job.skip_data[0], job.skip_data[1]) if job.skip_data else None
            launch = LaunchJob(
                event_id=f"launch-{job.id}-{job.attempt}",  # the same id for any re-publish of this attempt
                job_id=job.id,
                attempt=job.attempt,
                spec=JobSpec.model_validate(job.spec),
                placement=ranks,
                master_addr=master_addr,
                master_port=port,
                resume_from=job.resume_from,
                skip_data=skip,
            )
            nodes = ", ".join(f"{n} ({sum(r.node == n for r in ranks)} ranks)" for n in placement.nodes)
            assert states.outcome(job.state, job.queued, states.JobEvent.PLACED) == states.Outcome.SCHEDULE
            await lifecycle.transition(
                conn,
                job,
                JobState.SCHEDULED,
                f"attempt {job.attempt} placed on {nodes}{_resized(job, launch)}",
                placement=[r.model_dump() for r in ranks],
                master_addr=master_addr,
                master_port=port,
            )
            if _grew_back(job, launch):  # said where incidents are read too
                n, where = launch.spec.resources.nodes, f" from {job.resume_from}" if job.resume_from else ""
                message = f"grew back to {n} of {n} nodes (capacity returned): attempt {job.attempt}"
                message += f" on {nodes}{where}"
                await recovery.raise_about(conn, job, message, nodes=len(placement.nodes), ranks=len(ranks))
            await outbox.enqueue(conn, subjects.launch(job.id), launch)
        log.info("job %s attempt %d scheduled on %s", job.id, job.attempt, nodes)

    async def _master_port(self, conn: asyncpg.Connection, job: Job, master_addr: str) -> int:
        """A rendezvous port no other active job on that address uses, and not the last attempt's."""
        used = {
            r["master_port"]
            for r in await conn.fetch(
                """SELECT master_port FROM jobs WHERE master_addr = $1 AND master_port IS NOT NULL
                   AND state <> ALL($2::text[])""",
                master_addr,
                sorted(TERMINAL_STATES),
            )
        }
        while True:
            port = self._rng.choice(MASTER_PORTS)
            if port not in used:
                return port

    async def placement_loop(
        self, stop: asyncio.Event, poll_s: float = 2.0, pacing: Pacing = Pacing()
    ) -> None:
        """Run a pass whenever something may have freed or added room, and every `poll_s` anyway. A pass asked
        for right after another waits out `pacing`'s short gap, and serves every ask made meanwhile."""
        clock = asyncio.get_running_loop().time
        while not stop.is_set():
            self._placement_wanted.clear()
            started = clock()
            try:
                await self.schedule_pass()
            except (Conflict, asyncpg.PostgresError, OSError) as exc:
                log.warning("placement pass failed, retrying: %s", exc)
            ended = clock()
            asked = await wait_any(self._placement_wanted, stop, timeout_s=poll_s)
            if asked and (delay := pacing.delay(clock(), started, ended)) > 0:
                await wait_any(stop, timeout_s=delay)  # the asks until then join this pass

    # --- failure detection ----------------------------------------------------------------------------

    async def check_nodes(self) -> list[str]:
        """Mark silent nodes lost and requeue (or fail) the jobs that had ranks there."""
        assert self.started_at is not None
        async with self.tx() as conn:
            lost = await inventory.lost_nodes(conn, self.settings.node_lost_after, self.started_at)
            for node in lost:
                log.warning(
                    "node %s lost: no heartbeat for %d intervals", node, self.settings.node_lost_after
                )
                await self._requeue_jobs_on(
                    conn, node, f"no heartbeat for {self.settings.node_lost_after} intervals"
                )
        if lost:
            self.want_placement()
        return lost

    async def check_peers(self, job_id: str, node: str, why: str) -> list[str]:
        """A rank of `job_id` on `node` failed: its peers' nodes whose worker's NATS connection is closed
        (the server answers their ping "no responders") are lost now, not after three heartbeats. The
        failed collective and the closed connection together say the machine, or its worker and ranks,
        died; a worker that only restarts never fails a peer's collective. Returns the nodes lost."""
        if self.presence is None:
            return []
        async with self.pool.acquire() as conn:
            peers = [n for n in await inventory.nodes_of_job(conn, job_id) if n != node]
        gone = await self._gone(peers)
        if gone:  # asked twice: one "no responders" is not the whole proof
            await asyncio.sleep(PRESENCE_AGAIN_S)
            gone = await self._gone(gone)
        if not gone:
            return []
        async with self.tx() as conn:
            lost = await inventory.mark_lost(conn, gone)
            for n in lost:
                log.warning("node %s lost: its worker's connection is closed, and %s", n, why)
                await self._requeue_jobs_on(conn, n, f"its worker's connection is closed, and {why}")
        if lost:
            self.want_placement()
        return lost

    async def _gone(self, nodes: list[str]) -> list[str]:
        assert self.presence is not None
        answers = await asyncio.gather(*(self.presence(subjects.ping(n)) for n in nodes))
        return [n for n, a in zip(nodes, answers, strict=True) if a is Presence.GONE]

    async def _requeue_jobs_on(self, conn: asyncpg.Connection, node: str, why: str) -> None:
        for job_id in await inventory.jobs_on_node(conn, node):
            await self.requeue_locked(conn, job_id, f"node {node} lost ({why})", node=node)

    async def requeue_locked(
        self, conn: asyncpg.Connection, job_id: str, cause: str, *, node: str | None = None
    ) -> Job | None:
        """Requeue a job whose ranks are gone (inside the caller's transaction), with a node_lost
        incident when a node is to blame."""
        job = await lifecycle.lock_job(conn, job_id)
        if (
            job is None
            or states.outcome(job.state, job.queued, states.JobEvent.RANKS_LOST) != states.Outcome.REQUEUE
        ):
            return job
        moved = await lifecycle.requeue(conn, job, cause, max_attempts=self.settings.max_attempts)
        failed = moved.state == JobState.FAILED
        if node is not None:
            evidence: dict[str, Any] = {"requeued_as_attempt": None if failed else moved.attempt}
            message = cause
            resources = Resources.model_validate(job.spec.get("resources") or {})
            if resources.elastic is not None and not failed:
                evidence["elastic"] = {"min_nodes": resources.min_nodes, "nodes": resources.nodes}
                message += (
                    f"; elastic (resources.elastic.min_nodes {resources.min_nodes}): where no spare or free"
                    f" node replaces it, the job continues on fewer of its {resources.nodes} nodes"
                )
            await lifecycle.raise_incident(
                conn,
                job,
                IncidentRaised(
                    job_id=job.id,
                    attempt=job.attempt,
                    kind="node_lost",
                    action="fail" if failed else "alert",
                    node=node,
                    message=message,
                    evidence=evidence,
                ),
            )
        return moved

    async def start(self) -> None:
        """Note the start time (the database's clock): nodes get a full lost-after window from here."""
        self.started_at = await self.pool.fetchval("SELECT now()")

    async def liveness_loop(self, stop: asyncio.Event) -> None:
        if self.started_at is None:
            await self.start()
        tick = min(1.0, self.settings.heartbeat_interval_s / 2)
        forgotten_at = 0.0
        while not stop.is_set():
            try:
                await self.check_nodes()
                if time.monotonic() - forgotten_at > 600:  # Idempotency-Keys past their day, now and then
                    async with self.pool.acquire() as conn:
                        await idempotency_keys.forget_expired(conn)
                    forgotten_at = time.monotonic()
            except (asyncpg.PostgresError, OSError) as exc:
                log.warning("node check failed, retrying: %s", exc)
            await wait_any(stop, timeout_s=tick)


async def lock_placement(conn: asyncpg.Connection) -> None:
    """Hold the placement lock until the transaction ends: one placement pass, or one decision to grow a
    job (`Scheduler.whole_size_fits`), at a time across schedulers."""
    await conn.execute("SELECT pg_advisory_xact_lock($1)", _SCHEDULE_LOCK)


def _resized(job: Job, launch: LaunchJob) -> str:
    """What a launch's cause says of its size: an elastic job's attempt on fewer nodes than it asks for
    (and the gradient accumulation that keeps its global batch), or back to its size after one."""
    resources = launch.spec.resources
    world = launch.world_size
    if world < resources.world_size:
        nodes = len({r.node for r in launch.placement})
        said = (
            f": elastic, continues on {nodes} of {resources.nodes} nodes ({world} of {resources.world_size}"
            f" ranks; resources.elastic.min_nodes {resources.min_nodes}"
        )
        if launch.spec.entrypoint is None:  # the built-in trainer keeps the global batch so
            grad_accum = launch.spec.train.grad_accum
            said += f"; train.grad_accum {grad_accum} -> {grad_accum_at(resources, grad_accum, world)}"
        return said + ")"
    if _grew_back(job, launch):
        nodes = resources.nodes
        return f": elastic, grew back to {nodes} of {nodes} nodes (capacity returned; {world} ranks)"
    return ""


def _grew_back(job: Job, launch: LaunchJob) -> bool:
    """An elastic job's attempt at its whole size after one on fewer ranks."""
    return bool(job.previous_placement) and len(job.previous_placement or []) < launch.world_size


def _plain(value: Any) -> Any:
    """A mark's column as JSON holds it (times as ISO text)."""
    return value.isoformat() if isinstance(value, datetime) else value


async def _note_waiting(conn: asyncpg.Connection, jobs: dict[str, Job], waiting: dict[str, str]) -> None:
    """Store why each queued job waits on a quota (and clear it for one that no longer does)."""
    for job in jobs.values():
        reason = waiting.get(job.id)
        if reason != job.queue_reason:
            await conn.execute("UPDATE jobs SET queue_reason = $2 WHERE id = $1", job.id, reason)
