"""The training loop of one rank, in nanoGPT's shape: one function, sections in order.

Per step: data, forward, backward (DeepSpeed reduces gradients at the accumulation boundary), one small
control all-reduce (the SDK's `Run.agree`: finiteness guard, every rank's loss, out-of-memory,
preemption and command boundary), optimizer step, report, checkpoint, then `Run.after_step` as in any
program: an in-memory snapshot when due, the emergency checkpoint on a preemption notice, any command
all ranks agreed on (a halt waits there; a rollback loads in place through the run's loaders). A step
the ranks judge bad at the boundary is held and replayed (`replay`); a step that runs out of memory is
tried again with half the micro-batch (`oom`). Setup (process group, engine, data, run) is `rank.py`'s.
"""

from __future__ import annotations

import time

from vigil.boundary import Boundary
from vigil.identity import first_position
from vigil.integrations.deepspeed import skip_step
from vigil.recovery import Preempted
from vigil_trainer import park, replay
from vigil_trainer.checkpoint_collective import save_checkpoint, save_emergency_checkpoint
from vigil_trainer.context import RankContext, TrainState
from vigil_trainer.data import next_position
from vigil_trainer.micro import execute
from vigil_trainer.oom import halt_out_of_memory
from vigil_trainer.report import StepTimes, report_step


def train(ctx: RankContext, st: TrainState) -> TrainState:
    engine, spec, run = ctx.engine, ctx.spec, ctx.run
    # a preemption notice: every rank saves where it stands in `after_step`, then exits (requeued)
    run.on_preemption(lambda _next: save_emergency_checkpoint(ctx, st, "preemption notice"))

    while st.step < spec.train.steps:
        step = st.step
        ctx.comm.take()  # collectives outside the step (checkpoints, rollbacks) are not its comm time
        t0 = time.perf_counter()
        ctx.faults.act(step, run)  # an injected crash, hang or slow rank (tests and demos)
        park.raise_if_cut()  # the worker replaced this attempt: park (a collective fails of it first)
        lr = float(engine.get_lr()[0])

        # --- micro-steps (data, forward, backward), then the boundary all-reduce ------------------------
        m, agreed = execute(ctx, st, step)

        # --- a step judged bad at the boundary (a NaN, a spike) is held and replayed once ---------------
        if agreed.oom_rank is None and (bad := ctx.judge.judge(agreed.losses or (), agreed.all_finite)):
            m, agreed = replay.settle(ctx, st, step, bad, agreed)
        pos = st.data_position  # a step whose data the replay skipped ran on the next data
        comm_spans = ctx.comm.take_spans()  # read after the step's sync point
        if agreed.oom_rank is not None:  # the split step ran out of memory too: save and halt
            halt_out_of_memory(ctx, st, step, agreed.oom_rank)
            if not after_step(ctx, st, agreed):  # halted: waits for a resume, rollback or cancel
                return st
            continue

        # --- optimizer step at the accumulation boundary (every rank drops a non-finite update alike) ----
        te = ctx.clock.now()
        if agreed.all_finite:
            engine.step()  # DeepSpeed may still skip it (an fp16 overflow): was_step_applied says
        else:
            skip_step(engine)  # the SDK's one skip: the optimizer's step gated, checked, LR not moved
        tf = ctx.clock.now()
        ctx.clock.sync()  # CPU-GPU sync point, the step's one: every phase's marks are readable after it
        t_end = time.perf_counter()
        applied = bool(engine.was_step_applied())
        ctx.observer.on_step_end(step, t_end - t0)
        if applied:
            ctx.judge.add(step, agreed.losses or ())

        # --- report ---------------------------------------------------------------------------------------
        times = StepTimes(t0, t_end, (te, tf), comm_spans)
        report_step(ctx, st, step, pos, m, agreed, lr=lr, applied=applied, times=times)
        st.step, st.data_position = step + 1, next_position(pos, run.skip_windows)

        # --- checkpoint ---------------------------------------------------------------------------------
        if st.step % spec.checkpoint.every == 0:
            save_checkpoint(ctx, st)  # its step is kept in memory too (snapshots on)

        # --- the boundary's news, as for any program: snapshot, preemption, commands ------------------------
        if not after_step(ctx, st, agreed):
            return st
    return st


def after_step(ctx: RankContext, st: TrainState, agreed: Boundary) -> bool:
    """`Run.after_step` at the step boundary; after an in-place rollback, training moves to the step the
    run loaded. False: preempted (the emergency checkpoint is written, the rank exits to be requeued)."""
    run, generation = ctx.run, ctx.run.generation
    try:
        st.step = run.after_step(st.step, agreed, data_position=st.data_position)
    except Preempted:
        st.preempted = True
        return False
    if run.generation != generation and run.last_rollback is not None:
        rolled = run.last_rollback
        st.data_position = first_position(rolled.data_position, run.skip_windows)
        ctx.faults.clear_transient()
        ctx.judge.rewind(st.step)
        ctx.observer.on_rollback(rolled)
    return True
