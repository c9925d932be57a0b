"""What the job's commands do to the built-in trainer: halt, in-place rollback (DeepSpeed's checkpoint
loaded into the running engine), resume. Which commands to act on, and when, is the SDK's
(`vigil.commands.act`, the same for every program); cancel and restart are the worker's and the
scheduler's: they end these processes.
"""

from __future__ import annotations

import logging
import time

from vigil import events as ev
from vigil.commands import act
from vigil_worker.trainer.checkpoint_collective import load_checkpoint
from vigil_worker.trainer.context import RankContext, TrainState
from vigil_worker.trainer.data import first_position
from vigil_worker.trainer.observer import RollbackTiming
from vigil_worker.trainer.snapshots import rollback_from_memory

log = logging.getLogger("vigil.rank")


def handle_commands(ctx: RankContext, st: TrainState, agreed_seq: int) -> None:
    """Act on commands up to `agreed_seq` in order (every rank does the same), and while halted, on
    each next command as it comes. Halted ranks wait here, outside any collective."""
    act(ctx.run.link, st, agreed_seq, ctx.attempt, TrainerCommands(ctx, st))


class TrainerCommands:
    """The trainer's `vigil.commands.Handler`."""

    def __init__(self, ctx: RankContext, st: TrainState) -> None:
        self.ctx, self.st = ctx, st

    def halt(self, command: ev.HaltJob) -> None:
        report_halt(self.ctx, self.st, command.reason, command.event_id)

    def rollback(self, command: ev.RollbackJob, seq: int) -> None:
        rollback(self.ctx, self.st, command, seq)

    def resume(self, command: ev.ResumeJob) -> None:
        log.warning("resumed at step %d", self.st.step)


def halt(ctx: RankContext, st: TrainState, reason: str, command_id: str) -> None:
    """Stop stepping on the ranks' own account (an out-of-memory the retry did not cure): the caller
    then waits in `handle_commands` for a resume, rollback or cancel."""
    st.halted = True
    report_halt(ctx, st, reason, command_id)


def report_halt(ctx: RankContext, st: TrainState, reason: str, command_id: str) -> None:
    """Rank 0 reports that the ranks stopped (`command_id`: the HaltJob's, or the out-of-memory's)."""
    log.warning("halted after step %d: %s", st.step - 1, reason)
    if ctx.rank == 0:
        ctx.run.emit(
            ev.RanksHalted(
                job_id=ctx.job_id,
                attempt=ctx.attempt,
                step=max(st.step - 1, 0),
                command_id=command_id,
                node=ctx.node,
            )
        )


def rollback(ctx: RankContext, st: TrainState, cmd: ev.RollbackJob, seq: int) -> None:
    """Load a checkpoint in place (no process restart), add the data-skip window, and train on. The
    in-memory snapshot of the checkpoint's step, where every rank holds one, is loaded instead (no read:
    the same state); snapshots newer than the step are dropped either way."""
    t0 = time.perf_counter()
    acted, arrived = time.monotonic(), ctx.run.link.arrival(seq)
    from_step = max(st.step - 1, 0)
    load_s = rollback_from_memory(ctx, st, cmd.step)
    source = f"{cmd.checkpoint}, from memory"
    if load_s is None:
        m = ctx.run.choose_checkpoint(cmd.checkpoint, cmd.step)
        load_s, source = load_checkpoint(ctx, st, m), str(m.path)
    if ctx.snapshots is not None:
        ctx.snapshots.drop_after(st.step)
    if cmd.skip_data:
        st.skip_windows.append(tuple(cmd.skip_data))  # type: ignore[arg-type]
        st.data_position = first_position(st.data_position, st.skip_windows)
    ctx.faults.clear_transient()
    ctx.judge.rewind(st.step)
    st.halted = False
    st.generation += 1  # the steps from st.step on are a new run of them, beside the abandoned one
    duration = time.perf_counter() - t0
    log.warning("rolled back from step %d to %d (%s) in %.3fs", from_step, st.step, source, duration)
    ctx.observer.on_rollback(
        RollbackTiming(to_step=st.step, load_s=load_s, total_s=duration, arrived=arrived, acted=acted)
    )
    if ctx.rank == 0:
        ctx.run.emit(
            ev.RollbackCompleted(
                job_id=ctx.job_id,
                attempt=ctx.attempt,
                from_step=from_step,
                to_step=st.step,
                checkpoint=source.removesuffix(", from memory"),
                skip_data=cmd.skip_data,
                command_id=cmd.event_id,
                duration_s=duration,
                node=ctx.node,
            )
        )
