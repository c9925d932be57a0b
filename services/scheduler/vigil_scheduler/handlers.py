"""What the scheduler does with each event it consumes: heartbeats, status, commands and incidents.

Each handler records what the event says (a rank row, a checkpoint), classifies it as a `JobEvent` and
does what the one table, `states.OUTCOMES`, says for the job's phase (`vigil_scheduler.outcomes`). Every
handler is idempotent under redelivery: events of an older attempt than the job's are ignored, a duplicate
or late event is an `IGNORE` in the table, and no event is refused with a Conflict. The scheduler's own
JobStateChanged, CancelJob and incidents come back here and are ignored the same way.
"""

from __future__ import annotations

import logging
from dataclasses import replace
from datetime import datetime
from typing import assert_never

import asyncpg

from vigil.events import (
    CancelJob,
    CheckpointRefused,
    CheckpointSaved,
    DeviceDiagnosed,
    DiagnoseDevice,
    DumpStacks,
    GuardianSettingsChanged,
    HaltJob,
    IncidentRaised,
    JobCommand,
    JobStateChanged,
    Message,
    NodeHeartbeat,
    OutOfMemoryHalted,
    PreemptJob,
    RankExited,
    RanksHalted,
    RankStarted,
    ReportRefused,
    RestartJob,
    RestartRequested,
    ResumeJob,
    RollbackCompleted,
    RollbackJob,
    StacksDumped,
    StepReplayed,
    expect,
    is_incident,
    is_job_command,
    is_status,
    utcnow,
)
from vigil.jobstates import PREEMPTED, JobState
from vigil_common.bus import SENDER_HEADER, Delivery
from vigil_scheduler import audit, inventory, lifecycle, preempting, recovery, states, time_limits
from vigil_scheduler.core import Scheduler, lock_placement
from vigil_scheduler.lifecycle import Job
from vigil_scheduler.outcomes import Happened, Outcomes, supersede
from vigil_scheduler.states import JobEvent, Outcome

log = logging.getLogger(__name__)


class Handlers:
    def __init__(self, scheduler: Scheduler) -> None:
        self.s = scheduler
        self.outcomes = Outcomes(scheduler)
        self.apply = self.outcomes.apply  # what every handler does with what it classified

    # --- heartbeats -----------------------------------------------------------------------------------

    async def heartbeats(self, batch: list[tuple[Message, Delivery]]) -> None:
        latest: dict[str, NodeHeartbeat] = {}
        now = utcnow()
        for event, _ in batch:
            if isinstance(event, NodeHeartbeat) and not self._stale(event, now):
                latest[event.node] = event  # a batch is in stream order: keep each node's newest
        if not latest:
            return
        async with self.s.tx() as conn:
            results = await inventory.record_heartbeats(conn, list(latest.values()))
        restarted = [name for name, r in results.items() if r.restarted]
        changed = any(r.changed for r in results.values())
        for name in restarted:  # a new worker process: ranks it no longer reports are gone
            async with self.s.tx() as conn:
                for job_id in await inventory.jobs_with_vanished_ranks(conn, name):
                    await self.s.requeue_locked(
                        conn, job_id, f"the worker on node {name} restarted; its ranks are gone"
                    )
        if changed or restarted:
            self.s.want_placement()

    def _stale(self, hb: NodeHeartbeat, now: datetime) -> bool:
        """A heartbeat from before this scheduler started, or older than the lost-after window, says
        nothing about the node now (a restarted scheduler replays them from the stream)."""
        if self.s.started_at is not None and hb.occurred_at < self.s.started_at:
            return True
        return (now - hb.occurred_at).total_seconds() > self.s.settings.node_lost_after * hb.interval_s

    # --- status: ranks, checkpoints, rollbacks ------------------------------------------------------------

    async def status(self, event: Message, delivery: Delivery) -> None:
        status = expect(event, is_status, "status event")
        match status:
            case RankStarted():
                await self._on_current(status, self._rank_started)
            case RankExited():
                if status.job_id and _peer_failed(status):  # its peer may be a machine gone: ask first
                    why = f"rank {status.rank} on {status.node} failed ({status.failure})"
                    await self.s.check_peers(status.job_id, status.node, why)
                await self._on_current(status, self._rank_exited)
            case CheckpointSaved():
                await self._checkpoint_saved(status)
            case RanksHalted():
                await self._on_current(status, self._ranks_halted)
            case RollbackCompleted():
                await self._on_current(status, self._rollback_completed)
            case RestartRequested():
                await self._on_current(status, self._restart_requested)
            case CheckpointRefused():
                await self._checkpoint_refused(status)
            case DeviceDiagnosed():
                await self._device_diagnosed(status)
            case JobStateChanged() | GuardianSettingsChanged():
                pass  # our own, or history
            case OutOfMemoryHalted() | StepReplayed() | ReportRefused() | StacksDumped():
                pass  # the guardian's to judge: its incident or command comes back here if it acts
            case _:
                assert_never(status)

    async def _rank_started(self, conn: asyncpg.Connection, job: Job, event: RankStarted) -> None:
        if job.queued:  # an attempt not launched yet has no ranks: not recorded (`IMPOSSIBLE`)
            await self.apply(conn, job, Happened(JobEvent.RANK_STARTED, f"rank {event.rank} started"))
            return
        await conn.execute(
            """INSERT INTO job_ranks (job_id, attempt, rank, node, started_at) VALUES ($1, $2, $3, $4, $5)
               ON CONFLICT (job_id, attempt, rank) DO UPDATE SET node = $4,
                   started_at = COALESCE(job_ranks.started_at, $5)""",
            job.id,
            job.attempt,
            event.rank,
            event.node,
            event.occurred_at,
        )
        started = await conn.fetchval(
            "SELECT count(*) FROM job_ranks WHERE job_id = $1 AND attempt = $2 AND started_at IS NOT NULL",
            job.id,
            job.attempt,
        )
        if started >= job.attempt_world_size:
            cause = f"all {job.attempt_world_size} ranks started"
            await self.apply(conn, job, Happened(JobEvent.ALL_STARTED, cause))
        else:
            await self.apply(conn, job, Happened(JobEvent.RANK_STARTED, f"rank {event.rank} started"))

    async def _rank_exited(self, conn: asyncpg.Connection, job: Job, event: RankExited) -> None:
        if job.queued:  # an attempt not launched yet has no ranks: not recorded (`IMPOSSIBLE`)
            cause = f"rank {event.rank} exited ({event.failure})"
            await self.apply(conn, job, Happened(JobEvent.RANK_FINISHED, cause))
            return
        await conn.execute(
            """INSERT INTO job_ranks (job_id, attempt, rank, node, exited_at, exit_code, failure)
               VALUES ($1, $2, $3, $4, $5, $6, $7)
               ON CONFLICT (job_id, attempt, rank)
               DO UPDATE SET exited_at = $5, exit_code = $6, failure = $7""",
            job.id,
            job.attempt,
            event.rank,
            event.node,
            event.occurred_at,
            event.exit_code,
            event.failure,
        )
        await self.apply(conn, job, await _classify_exit(conn, job, event))

    async def _checkpoint_saved(self, event: CheckpointSaved) -> None:
        async with self.s.tx() as conn:
            if event.job_id is None or (job := await lifecycle.get_job(conn, event.job_id)) is None:
                return
            await conn.execute(
                """INSERT INTO scheduler_checkpoints (job_id, step, path, data_position, attempt)
                   VALUES ($1, $2, $3, $4, $5)
                   ON CONFLICT (job_id, step) DO UPDATE SET path = $3, data_position = $4, attempt = $5,
                       valid = true, refused = NULL, saved_at = now()""",
                event.job_id,
                event.step,
                event.path,
                event.data_position,
                event.attempt,
            )
        if _may_grow(job) and event.attempt == job.attempt:
            await self._grow(event)

    async def _grow(self, event: CheckpointSaved) -> None:
        """An elastic job running on fewer nodes than it asks for reached a checkpoint boundary: when the
        queue would place it at its whole size now (`Scheduler.whole_size_fits`), this attempt ends and the
        next, at that size, resumes from this checkpoint (`Outcome.GROW`). Decided under the placement lock,
        so the placement pass that follows sees the queue this decision saw."""
        async with self.s.tx() as conn:
            await lock_placement(conn)
            job = await self._current(conn, event)
            if job is None or not _may_grow(job):
                return
            fit = await self.s.whole_size_fits(conn, job)
            if fit is None:
                return  # no room yet, or a job ahead of it takes it: the next checkpoint asks again
            nodes, step = len(fit.nodes), event.step
            cause = (
                f"{lifecycle.GROW_BACK} to {nodes} nodes (capacity returned): attempt {job.attempt + 1}"
                f" resumes at {job.world_size} ranks from the checkpoint of step {step}"
            )
            await self.apply(conn, job, Happened(JobEvent.GROW, cause, target=(event.step, event.path, None)))

    async def _checkpoint_refused(self, event: CheckpointRefused) -> None:
        """A checkpoint that did not load is bad for good (of any attempt: the files do not heal)."""
        async with self.s.tx() as conn:
            if event.job_id and await lifecycle.refuse_checkpoint(
                conn, event.job_id, event.step, event.reason
            ):
                log.warning(
                    "%s: checkpoint %s marked bad (%s): %s",
                    event.job_id,
                    event.path,
                    event.reason,
                    event.message,
                )

    async def _device_diagnosed(self, event: DeviceDiagnosed) -> None:
        """The worker's own known-answer check failed on its device: a confirmed mark (never expires)."""
        if event.passed is not False:
            return
        reason = f"failed the worker's known-answer check ({_checks(event)})"
        async with self.s.tx() as conn:
            if await inventory.mark_unhealthy(
                conn, event.node, event.device, reason, source="diagnostic", job_id=event.job_id
            ):
                log.warning("device %s:%d marked unhealthy: %s", event.node, event.device, reason)
        self.s.want_placement()

    async def _mark_from_replays(
        self, conn: asyncpg.Connection, job_id: str, node: str, index: int, why: str
    ) -> None:
        """A mark a job's replays led to: it expires (VIGIL_DEVICE_MARK_TTL_S) and counts against the
        job's VIGIL_DEVICE_MARKS_PER_JOB."""
        settings = self.s.settings
        if await inventory.mark_unhealthy(
            conn,
            node,
            index,
            why,
            source="replay",
            job_id=job_id,
            ttl_s=settings.device_mark_ttl_s,
            per_job=settings.device_marks_per_job,
        ):
            log.warning("device %s:%d marked unhealthy: %s", node, index, why)

    async def _ranks_halted(self, conn: asyncpg.Connection, job: Job, event: RanksHalted) -> None:
        if job.state in (JobState.RUNNING, JobState.HALTED, JobState.ROLLING_BACK) and not job.queued:
            # they wait there now: for a rollback, a resume or a cancel
            job = await lifecycle.note_progress(conn, job.id, recovery.under(job, halted_step=event.step))
        await self.apply(conn, job, Happened(JobEvent.RANKS_HALTED, f"ranks halted at step {event.step}"))

    async def _rollback_completed(self, conn: asyncpg.Connection, job: Job, event: RollbackCompleted) -> None:
        await supersede(conn, job.id, after_step=event.to_step)
        # Remembered, so a RollbackJob that reaches us after its completion changes nothing.
        await conn.execute(
            "UPDATE jobs SET completed_commands = array_append(completed_commands, $2) WHERE id = $1",
            job.id,
            event.command_id,
        )
        cause = f"rolled back from step {event.from_step} to {event.to_step} ({event.checkpoint})"
        await self.apply(conn, job, Happened(JobEvent.ROLLBACK_COMPLETED, cause))

    # --- commands (from the guardian, or other tools) ----------------------------------------------------

    async def commands(self, event: Message, delivery: Delivery) -> None:
        command = expect(event, is_job_command, "job command")
        await self._audit(command, delivery)
        match command:
            case HaltJob():
                await self._on_current(command, self._halt)
            case RollbackJob():
                await self._on_current(command, self._rollback)
            case RestartJob():
                await self._on_current(command, self._restart)
            case ResumeJob():
                await self._on_current(command, self._resume)
            case CancelJob():
                await self._on_current(command, self._cancelled)
            case DiagnoseDevice() | DumpStacks():
                pass  # the workers': the scheduler keeps no state about them
            case PreemptJob():
                pass  # the scheduler's own (`preempting`): recorded and audited when it was sent
            case _:
                assert_never(command)

    async def _audit(self, event: JobCommand, delivery: Delivery) -> None:
        """Who asked for a command seen on the bus (`audit.service_actor`). A CancelJob of a job already
        ended changes nothing and is not recorded: the scheduler's own (asked through the API, and
        recorded there with the principal) come after the job is CANCELLED or FAILED. Which header a
        publisher sets decides nothing here."""
        sender = delivery.headers.get(SENDER_HEADER)
        action = _AUDITED.get(type(event))
        if action is None:
            return
        detail = {
            k: v for k, v in event.model_dump(mode="json").items() if k in ("reason", "step", "checkpoint")
        }
        async with self.s.tx() as conn:
            if action == "cancel":
                job = await lifecycle.get_job(conn, event.job_id) if event.job_id else None
                if job is None or job.terminal:
                    return
            await audit.record(
                conn,
                action,
                audit.service_actor(sender),
                event.job_id,  # type: ignore[attr-defined]
                event.attempt,  # type: ignore[attr-defined]
                event_id=event.event_id,
                detail=detail,
            )

    async def _halt(self, conn: asyncpg.Connection, job: Job, event: HaltJob) -> None:
        await self.apply(conn, job, Happened(JobEvent.HALT, f"halted: {event.reason}", command=event))

    async def _restart_requested(self, conn: asyncpg.Connection, job: Job, event: RestartRequested) -> None:
        """Ranks told to roll back in place whose program cannot: relaunch them from the checkpoint."""
        if event.command_id in job.completed_commands:
            return
        await conn.execute(
            "UPDATE jobs SET completed_commands = array_append(completed_commands, $2) WHERE id = $1",
            job.id,
            event.command_id,
        )
        reason = f"the program cannot roll back in place (command {event.command_id})"
        target = (event.step, event.checkpoint, event.skip_data)
        await self.apply(conn, job, Happened(JobEvent.RESTART_REQUESTED, reason, target=target))

    async def _restart(self, conn: asyncpg.Connection, job: Job, event: RestartJob) -> None:
        """The next attempt, from the checkpoint: the ranks of this one are ended by the new launch."""
        if event.event_id in job.completed_commands:
            return
        if states.outcome(job.state, job.queued, JobEvent.RESTART) == Outcome.RELAUNCH:
            for node, index in event.unhealthy:  # marked first: the relaunch's placement leaves them out
                await self._mark_from_replays(conn, job.id, node, index, event.reason)
        target = (event.step, event.checkpoint, event.skip_data)
        await self.apply(conn, job, Happened(JobEvent.RESTART, event.reason, target=target))

    async def _rollback(self, conn: asyncpg.Connection, job: Job, event: RollbackJob) -> None:
        if event.event_id in job.completed_commands:
            return  # it completed before it reached us
        cause = f"rollback to step {event.step}: {event.reason}"
        await self.apply(conn, job, Happened(JobEvent.ROLLBACK, cause, command=event))

    async def _resume(self, conn: asyncpg.Connection, job: Job, event: ResumeJob) -> None:
        await self.apply(conn, job, Happened(JobEvent.RESUME, f"resumed: {event.reason or 'by command'}"))

    async def _cancelled(self, conn: asyncpg.Connection, job: Job, event: CancelJob) -> None:
        # Our own cancels are terminal already; this one came from another tool (the guardian).
        cause = f"CancelJob: {event.reason or 'no reason given'}"
        await self.apply(conn, job, Happened(JobEvent.CANCEL, cause, reason=event.reason))

    # --- incidents -----------------------------------------------------------------------------------------

    async def incidents(self, message: Message, delivery: Delivery) -> None:
        event = expect(message, is_incident, "incident")
        if event.kind == "gpu_health" and event.node is not None and event.device is not None:
            async with self.s.tx() as conn:  # the worker's NVML samples: confirmed
                if await inventory.mark_unhealthy(conn, event.node, event.device, event.message):
                    log.warning("device %s:%d marked unhealthy: %s", event.node, event.device, event.message)
        elif event.kind == "sdc" and event.job_id and event.node is not None and event.device is not None:
            async with self.s.tx() as conn:
                await self._mark_from_replays(conn, event.job_id, event.node, event.device, event.message)
        match event.action:
            case "halt" | "rollback" | "restart":  # the job stops, or goes back: was the update applied?
                if event.job_id:
                    await self._on_current(event, self._incident_noted)
            case "fail":
                await self._on_current(event, self._fail)
            case "alert" | "replay" | "skip":
                pass  # the job runs on
            case _:
                assert_never(event.action)

    async def _incident_noted(self, conn: asyncpg.Connection, job: Job, event: IncidentRaised) -> None:
        """The incident behind a halt, rollback or restart: was the bad step's update applied? A rollback
        whose ranks finished first waits for this (`states.settlement`)."""
        unapplied = recovery.incident_unapplied(event)
        await recovery.note_incident(conn, job.id, event.event_id, unapplied)
        job = replace(job, recovery_incidents={**job.recovery_incidents, event.event_id: unapplied})
        what = "never applied" if unapplied else "applied"
        await self.apply(conn, job, Happened(JobEvent.INCIDENT_NOTED, f"the bad step's update was {what}"))

    async def _fail(self, conn: asyncpg.Connection, job: Job, event: IncidentRaised) -> None:
        cause = f"{event.kind}: {event.message}"
        await self.apply(conn, job, Happened(JobEvent.FAIL, cause, reason=event.message))

    # --- helpers -------------------------------------------------------------------------------------------

    async def _current(self, conn: asyncpg.Connection, event: Message) -> Job | None:
        """The event's job, locked, when the event is about its current attempt and it has not ended."""
        job = await lifecycle.lock_job(conn, event.job_id)
        if job is None or job.terminal or event.attempt != job.attempt:
            return None
        return job

    async def _on_current(self, event, apply) -> None:  # type: ignore[no-untyped-def]
        async with self.s.tx() as conn:
            job = await self._current(conn, event)
            if job is not None:
                await apply(conn, job, event)


def _may_grow(job: Job) -> bool:
    """An elastic job whose attempt runs on fewer ranks than it asks for, in a phase where it grows."""
    return (
        job.attempt_world_size < job.world_size
        and bool((job.spec.get("resources") or {}).get("elastic"))
        and states.outcome(job.state, job.queued, JobEvent.GROW) == Outcome.GROW
    )


def _checks(event: DeviceDiagnosed) -> str:
    return ", ".join(f"{name} off by {err:.3g}" for name, err in event.checks.items()) or event.error or "?"


BUS_NAME = "scheduler"  # the scheduler's own bus connection (vigil_scheduler.main), the sender of its cancels
_AUDITED: dict[type[Message], audit.Action] = {
    HaltJob: "halt",
    RollbackJob: "rollback",
    RestartJob: "restart",
    ResumeJob: "resume",
    CancelJob: "cancel",
}


def _peer_failed(event: RankExited) -> bool:
    """A rank that failed on its own (not ended by Vigil, preempted, refused, nor exited 0): on a job of
    several nodes, a collective that lost its peer is the commonest such failure."""
    return event.exit_code != 0 and event.failure not in ("ok", "killed_by_vigil", "preempted", "spec")


async def _classify_exit(conn: asyncpg.Connection, job: Job, event: RankExited) -> Happened:
    """What a rank's exit (already recorded) means for its attempt."""
    if event.exit_code == 0:
        ok = await conn.fetchval(
            "SELECT count(*) FROM job_ranks WHERE job_id = $1 AND attempt = $2 AND exit_code = 0",
            job.id,
            job.attempt,
        )
        if ok >= job.attempt_world_size:
            return Happened(JobEvent.ALL_FINISHED, f"all {job.attempt_world_size} ranks exited 0")
        return Happened(JobEvent.RANK_FINISHED, f"rank {event.rank} exited 0")
    how = f"code {event.exit_code}" if event.exit_code is not None else f"signal {event.signal}"
    cause = f"rank {event.rank} on {event.node} exited with {how} ({event.failure})"
    stopped = await preempting.stop_of(conn, job)  # the scheduler's own notice, if it sent one
    if stopped is not None and stopped.kind == "time_limit":  # ended, not requeued
        happened, cause = await time_limits.at_limit(conn, job, event.rank, stopped.reason)
        return Happened(happened, cause, reason=cause)
    if event.failure == "preempted":  # all ranks saved the emergency checkpoint
        cause = f"{PREEMPTED}: rank {event.rank} on {event.node} checkpointed and exited"
        if stopped is not None:  # "preempted by j-... (priority 50 > 10): needs 4 GPUs; rank 0 on ..."
            cause = f"{stopped.reason}; rank {event.rank} on {event.node} checkpointed and exited"
        return Happened(JobEvent.RANK_PREEMPTED, cause, preempted=True)
    if event.failure == "killed_by_vigil":
        # A worker ends a rank's siblings when it dies: the rank that died tells us why. Only when every
        # rank is gone without such a report is this the cause.
        exited = await conn.fetchval(
            "SELECT count(*) FROM job_ranks WHERE job_id = $1 AND attempt = $2 AND exited_at IS NOT NULL",
            job.id,
            job.attempt,
        )
        if exited < job.attempt_world_size:
            return Happened(JobEvent.RANK_ENDED, cause)
        cause = f"every rank was ended by its worker (last: rank {event.rank} on {event.node})"
        return Happened(JobEvent.ALL_ENDED, cause)
    if event.failure == "spec":  # another attempt would be refused the same way
        reason = f"the spec cannot run: {event.log_tail or cause}"[:2000]
        return Happened(JobEvent.SPEC_REFUSED, cause, reason=reason)
    return Happened(JobEvent.RANK_FAILED, cause)
