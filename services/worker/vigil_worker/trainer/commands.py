"""Commands at a step boundary: halt, in-place rollback, resume.

Every rank watches the job's command subject and sees the commands in the same order; the loop's
boundary all-reduce (`guard.agree`) makes all ranks act on the same ones after the same step.
Cancel and restart rollbacks are the worker's: it ends these processes.
"""

from __future__ import annotations

import logging
import time

from vigil_common import events as ev
from vigil_common import subjects
from vigil_worker.trainer.checkpoint_collective import choose_checkpoint, load_checkpoint
from vigil_worker.trainer.context import RankContext, TrainState
from vigil_worker.trainer.data import first_position
from vigil_worker.trainer.observer import RollbackTiming

log = logging.getLogger("vigil.rank")

COMMAND_ARRIVAL_TIMEOUT_S = 60.0  # an agreed command must reach every rank's bus thread by then


def handle_commands(ctx: RankContext, st: TrainState, agreed_seq: int) -> None:
    """Act on commands up to `agreed_seq` in order (every rank does the same), and while halted, on
    each next command as it comes. Halted ranks wait here, outside any collective."""
    while st.handled_seq < agreed_seq or st.halted:
        seq = st.handled_seq + 1
        try:
            cmd = ctx.sink.command(seq, COMMAND_ARRIVAL_TIMEOUT_S)
        except TimeoutError:
            if st.halted and seq > agreed_seq:
                continue  # halted: wait as long as it takes
            raise
        st.handled_seq = seq
        if cmd.attempt != ctx.attempt:
            log.info("ignoring %s for attempt %d (this is attempt %d)", cmd.type, cmd.attempt, ctx.attempt)
            continue
        if isinstance(cmd, ev.HaltJob) and not st.halted:
            halt(ctx, st, cmd.reason, cmd.event_id)
        elif isinstance(cmd, ev.RollbackJob) and not cmd.restart:
            rollback(ctx, st, cmd, seq)
        elif isinstance(cmd, ev.ResumeJob) and st.halted:
            st.halted = False
            log.warning("resumed at step %d", st.step)


def halt(ctx: RankContext, st: TrainState, reason: str, command_id: str) -> None:
    """Stop stepping (the caller waits for the next command); rank 0 reports it. `command_id`: the
    HaltJob's, or the incident's when the ranks halt on their own (an out-of-memory)."""
    st.halted = True
    log.warning("halted after step %d: %s", st.step - 1, reason)
    if ctx.rank == 0:
        ctx.sink.emit(
            subjects.status(ctx.job_id),
            ev.RanksHalted(
                job_id=ctx.job_id,
                attempt=ctx.attempt,
                step=max(st.step - 1, 0),
                command_id=command_id,
                node=ctx.node,
            ),
        )


def rollback(ctx: RankContext, st: TrainState, cmd: ev.RollbackJob, seq: int) -> None:
    """Load a checkpoint in place (no process restart), add the data-skip window, and train on."""
    t0 = time.perf_counter()
    acted, arrived = time.monotonic(), ctx.sink.arrival(seq)
    from_step = max(st.step - 1, 0)
    m = choose_checkpoint(ctx, cmd.checkpoint, cmd.step)
    load_s = load_checkpoint(ctx, st, m)
    if cmd.skip_data:
        st.skip_windows.append(tuple(cmd.skip_data))  # type: ignore[arg-type]
        st.data_position = first_position(st.data_position, st.skip_windows)
    ctx.faults.clear_transient()
    st.halted = False
    duration = time.perf_counter() - t0
    log.warning("rolled back from step %d to %d (%s) in %.3fs", from_step, st.step, m.path, duration)
    ctx.observer.on_rollback(
        RollbackTiming(to_step=st.step, load_s=load_s, total_s=duration, arrived=arrived, acted=acted)
    )
    if ctx.rank == 0:
        ctx.sink.emit(
            subjects.status(ctx.job_id),
            ev.RollbackCompleted(
                job_id=ctx.job_id,
                attempt=ctx.attempt,
                from_step=from_step,
                to_step=st.step,
                checkpoint=str(m.path),
                skip_data=cmd.skip_data,
                command_id=cmd.event_id,
                duration_s=duration,
                node=ctx.node,
            ),
        )
