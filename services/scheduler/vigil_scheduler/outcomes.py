"""What each classified event does to a job (`Outcomes.apply`: the one table, `states.OUTCOMES`, for the
job's phase), and the sweeper that resolves a job stalled in a transition and stops an attempt past its
time limit (`Outcomes.sweep_loop`).

The handlers (`vigil_scheduler.handlers`) record what an event says and classify it as a `Happened`; this
module acts on it: a transition, a requeue, a relaunch from a checkpoint, the settlement of a recovery
whose ranks finished first.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from typing import assert_never

import asyncpg

from vigil.errors import VigilError
from vigil.events import (
    CancelJob,
    HaltJob,
    IncidentAction,
    RollbackJob,
)
from vigil.jobstates import JobState
from vigil_common import subjects
from vigil_common.service import wait_any
from vigil_scheduler import lifecycle, outbox, preempting, recovery, states, time_limits
from vigil_scheduler.core import Scheduler
from vigil_scheduler.lifecycle import Job
from vigil_scheduler.states import JobEvent, Outcome, Settlement

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Happened:
    """An event, classified, with what its outcome needs: the transition's cause, the reason a job fails
    or is cancelled for, the halt or rollback command, a relaunch's (step, checkpoint, skip_data)."""

    event: JobEvent
    cause: str
    reason: str | None = None
    command: HaltJob | RollbackJob | None = None
    target: tuple[int, str, tuple[int, int] | None] | None = None
    preempted: bool = False


class Outcomes:
    def __init__(self, scheduler: Scheduler) -> None:
        self.s = scheduler

    # --- the table's outcomes ----------------------------------------------------------------------------

    async def apply(self, conn: asyncpg.Connection, job: Job, happened: Happened) -> Job:
        """Do what `states.OUTCOMES` says `happened` does to `job` (locked, its current attempt)."""
        outcome = states.outcome(job.state, job.queued, happened.event)
        moved = await self._do(conn, job, outcome, happened)
        if outcome in (Outcome.RUN, Outcome.ROLL_BACK) and (await recovery.exits(conn, moved)).finished:
            # the ranks finished before the command reached them (or the resume)
            done = Happened(JobEvent.ALL_FINISHED, f"all {job.attempt_world_size} ranks exited 0")
            moved = await self.apply(conn, moved, done)
        return moved

    async def _do(  # one case per outcome, as the table lists them
        self, conn: asyncpg.Connection, job: Job, outcome: Outcome, happened: Happened
    ) -> Job:
        cause = happened.cause
        match outcome:
            case Outcome.IGNORE:
                log.debug("%s: %s in %s changes nothing (%s)", job.id, happened.event, job.state, cause)
                return job
            case Outcome.WAIT:
                return await lifecycle.note_progress(conn, job.id)
            case Outcome.IMPOSSIBLE:
                where = states.phase(job.state, job.queued)
                message = f"{happened.event} cannot happen to a {where} job: {cause}"
                log.error("%s attempt %d: %s; ignored", job.id, job.attempt, message)
                await recovery.raise_about(conn, job, message, event=str(happened.event))
                return job
            case Outcome.SCHEDULE:
                raise AssertionError("a job is placed by the placement pass, not by an event")
            case Outcome.RUN:
                return await lifecycle.transition(conn, job, JobState.RUNNING, cause)
            case Outcome.HALT:
                extra = {}
                if isinstance(happened.command, HaltJob):
                    extra["recovery"] = recovery.under(job, halt=recovery.halt_record(happened.command))
                return await lifecycle.transition(conn, job, JobState.HALTED, cause, **extra)
            case Outcome.ROLL_BACK:
                assert isinstance(happened.command, RollbackJob)
                rec = recovery.under(job, rollback=recovery.rollback_record(happened.command))
                return await lifecycle.transition(conn, job, JobState.ROLLING_BACK, cause, recovery=rec)
            case Outcome.SUCCEED:
                moved = await lifecycle.transition(conn, job, JobState.SUCCEEDED, cause)
                self.s.want_placement()
                return moved
            case Outcome.REQUEUE:
                return await self._requeue(conn, job, happened)
            case Outcome.RELAUNCH:
                assert happened.target is not None
                step, checkpoint, skip = happened.target
                return await self._relaunch(conn, job, step, checkpoint, skip, cause)
            case Outcome.GROW:
                assert happened.target is not None and happened.cause.startswith(lifecycle.GROW_BACK)
                moved = await lifecycle.requeue(  # its devices stay its own until it is placed again
                    conn,
                    job,
                    cause,
                    max_attempts=self.s.settings.max_attempts,
                    to_state=JobState.ROLLING_BACK,
                    resume_from=happened.target[1],
                    counted=False,
                )
                self.s.want_placement()
                return moved
            case Outcome.SETTLE:
                return await self._settle(conn, job, happened)
            case Outcome.UNQUEUE:
                moved = await lifecycle.transition(conn, job, JobState.PENDING, cause)
                await recovery.raise_about(conn, job, cause)
                self.s.want_placement()
                return moved
            case Outcome.FAIL:
                moved = await lifecycle.fail(conn, job, cause, reason=(happened.reason or cause)[:2000])
                self.s.want_placement()
                return moved
            case Outcome.CANCEL:
                moved = await lifecycle.transition(
                    conn, job, JobState.CANCELLED, cause, reason=happened.reason
                )
                self.s.want_placement()
                return moved
            case Outcome.STOP:  # the placement pass stops its victims itself (`preempting.preempt_for`)
                assert happened.event == JobEvent.OVER_TIME
                await preempting.stop(conn, job, "time_limit", cause)
                return job
            case _:
                assert_never(outcome)

    async def _requeue(self, conn: asyncpg.Connection, job: Job, happened: Happened) -> Job:
        """The next attempt, queued: from the rollback under way's checkpoint, if any, else the newest."""
        resume_from = None
        if (target := recovery.rollback_target(job)) is not None:
            await supersede(conn, job.id, after_step=target[0])
            resume_from = target[1]
        moved = await lifecycle.requeue(
            conn,
            job,
            happened.cause,
            max_attempts=self.s.settings.max_attempts,
            resume_from=resume_from,
            preempted=happened.preempted,
        )
        if happened.event == JobEvent.TIMED_OUT:
            action: IncidentAction = "fail" if moved.state == JobState.FAILED else "alert"
            await recovery.raise_about(conn, job, happened.cause, action=action)
        self.s.want_placement()
        return moved

    async def _relaunch(
        self,
        conn: asyncpg.Connection,
        job: Job,
        step: int,
        checkpoint: str | None,
        skip_data: tuple[int, int] | None,
        reason: str,
    ) -> Job:
        """The next attempt from `checkpoint` (None: the newest valid), ROLLING_BACK until it is placed."""
        if checkpoint is not None:
            await supersede(conn, job.id, after_step=step)
        moved = await lifecycle.requeue(
            conn,
            job,
            f"restart from step {step}: {reason}" if checkpoint is not None else f"restart: {reason}",
            max_attempts=self.s.settings.max_attempts,
            to_state=JobState.ROLLING_BACK,
            resume_from=checkpoint,
            skip_data=skip_data,
        )
        self.s.want_placement()
        return moved

    async def _settle(self, conn: asyncpg.Connection, job: Job, happened: Happened) -> Job:
        """A halted or rolling-back attempt whose ranks finished, or that made no progress: `settlement`."""
        found = await recovery.exits(conn, job)
        timed_out = happened.event == JobEvent.TIMED_OUT
        rec = job.recovery or {}
        unapplied = recovery.unapplied(job)
        decided = states.settlement(
            finished=found.finished,
            exited=bool(found.ok),
            rollback="rollback" in rec,
            halted="halted_step" in rec,
            unapplied=unapplied,
            timed_out=timed_out,
        )
        command = "rollback" if "rollback" in rec else "halt"
        why = happened.cause if timed_out else f"the ranks finished before the {command} reached them"
        match decided:
            case Settlement.WAIT:
                return await lifecycle.note_progress(conn, job.id) if timed_out else job
            case Settlement.SUCCEED:
                cause = f"{why}; the bad step's update was never applied (held, or skipped as non-finite)"
                moved = await lifecycle.transition(conn, job, JobState.SUCCEEDED, cause)
                if not found.finished:  # a rank whose exit we never heard of: make sure it is gone
                    await outbox.enqueue(
                        conn,
                        subjects.cmd(job.id),
                        CancelJob(job_id=job.id, attempt=job.attempt, reason=f"succeeded: {cause}"),
                    )
                await recovery.raise_about(conn, job, f"SUCCEEDED: {cause}", exited=sorted(found.exited))
                self.s.want_placement()
                return moved
            case Settlement.RELAUNCH:
                target = recovery.rollback_target(job)
                step, checkpoint, skip = target if target else (0, None, None)
                if unapplied is None and found.ok:
                    why += "; the incident of the bad step never arrived"
                moved = await self._relaunch(conn, job, step, checkpoint, skip, why)
                action: IncidentAction = "fail" if moved.state == JobState.FAILED else "alert"
                where = f"from checkpoint {checkpoint}" if checkpoint else "from the newest valid checkpoint"
                done = f"relaunched as attempt {moved.attempt} {where}" if action == "alert" else moved.reason
                await recovery.raise_about(conn, job, f"{why}: {done}", action=action)
                return moved
            case Settlement.FAIL:
                cause = f"{why}; the bad step's update was applied and no rollback was asked for"
                moved = await lifecycle.fail(conn, job, cause, reason=cause)
                await recovery.raise_about(conn, job, cause, action="fail")
                self.s.want_placement()
                return moved
            case _:
                assert_never(decided)

    # --- the sweeper -------------------------------------------------------------------------------------

    async def sweep(self) -> list[str]:
        """Resolve every job that stayed placed-not-started, halting, rolling back or restarting for longer
        than VIGIL_TRANSITION_TIMEOUT_S without progress (`states.SWEPT`). The ids of those it acted on."""
        bound = self.s.settings.transition_timeout_s
        async with self.s.tx() as conn:
            ids = await conn.fetch(
                """SELECT id FROM jobs WHERE state = ANY($1::text[])
                   AND progress_at < now() - make_interval(secs => $2) ORDER BY progress_at LIMIT 100""",
                [JobState.SCHEDULED, JobState.HALTED, JobState.ROLLING_BACK],
                bound,
            )
        swept = []
        for row in ids:
            try:
                if await self._sweep_one(row["id"], bound):
                    swept.append(row["id"])
            except VigilError as exc:  # one job's trouble must not stop the sweep of the others
                log.error("%s: the transition sweep could not resolve it: %s", row["id"], exc)
        return swept

    async def _sweep_one(self, job_id: str, bound: float) -> bool:
        """Resolve one stalled job (`TIMED_OUT`); False when it moved meanwhile."""
        async with self.s.tx() as conn:
            job = await lifecycle.lock_job(conn, job_id)
            if job is None or states.phase(job.state, job.queued) not in states.SWEPT:
                return False
            if await conn.fetchval(
                "SELECT progress_at >= now() - make_interval(secs => $2) FROM jobs WHERE id = $1",
                job.id,
                bound,
            ):
                return False  # it moved meanwhile
            found = await recovery.exits(conn, job)
            if job.state == JobState.SCHEDULED:
                what = f"attempt {job.attempt} was launched but {found.never_started()} in {bound:g}s"
            elif job.queued:
                what = f"the restart found no placement in {bound:g}s; it waits in the queue"
            else:
                what = recovery.what_stalled(job, found, bound)
            log.warning("%s attempt %d: %s", job.id, job.attempt, what)
            await self.apply(conn, job, Happened(JobEvent.TIMED_OUT, what))
        return True

    async def stop_overdue(self) -> list[str]:
        """Stop every attempt running past its time limit (`time_limits.overdue`): the spot path's notice,
        the grace period and the emergency checkpoint, then the job ends (`OVER_TIME`). The ids stopped."""
        default = self.s.settings.time_limit_default_s
        async with self.s.pool.acquire() as conn:
            due = await time_limits.overdue(conn, default)
        for job_id in due:
            async with self.s.tx() as conn:
                job = await lifecycle.lock_job(conn, job_id)
                if job is None or not await time_limits.overdue(conn, default, job_id):
                    continue  # it moved meanwhile
                why = time_limits.notice(job, default)
                log.warning("%s: %s", job.id, why)
                await self.apply(conn, job, Happened(JobEvent.OVER_TIME, why))
        return due

    async def sweep_loop(self, stop: asyncio.Event) -> None:
        tick = min(5.0, max(0.2, self.s.settings.transition_timeout_s / 4))
        while not stop.is_set():
            try:
                await self.sweep()
                await self.stop_overdue()
            except (asyncpg.PostgresError, OSError, VigilError) as exc:
                log.warning("transition sweep failed, retrying: %s", exc)
            await wait_any(stop, timeout_s=tick)


async def supersede(conn: asyncpg.Connection, job_id: str, *, after_step: int) -> None:
    """Checkpoints past a rollback's target are from the abandoned timeline: never resume from them."""
    await conn.execute(
        "UPDATE scheduler_checkpoints SET valid = false WHERE job_id = $1 AND step > $2", job_id, after_step
    )
