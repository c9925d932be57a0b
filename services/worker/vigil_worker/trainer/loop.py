"""The training loop of one rank, in nanoGPT's shape: one function, sections in order.

Per step: data, forward, backward (DeepSpeed reduces gradients at the accumulation boundary), one small
control all-reduce (finiteness guard, every rank's loss, out-of-memory, preemption and command
boundary), optimizer step, emit, checkpoint, in-memory snapshot, the emergency checkpoint on a
preemption notice, then any command all ranks agreed on. A step the ranks judge bad at the boundary is
held and replayed (`replay`); a step that runs out of memory is tried again with half the micro-batch
(`oom`). Setup (process group, engine, data, sink) is `rank.py`'s.
"""

from __future__ import annotations

import time

from vigil.integrations.deepspeed import skip_step
from vigil_worker.trainer import replay
from vigil_worker.trainer.checkpoint_collective import save_checkpoint, save_emergency_checkpoint
from vigil_worker.trainer.commands import handle_commands
from vigil_worker.trainer.context import RankContext, TrainState
from vigil_worker.trainer.data import next_position
from vigil_worker.trainer.micro import execute
from vigil_worker.trainer.oom import halt_out_of_memory
from vigil_worker.trainer.report import StepTimes, report_step
from vigil_worker.trainer.snapshots import take_snapshot


def train(ctx: RankContext, st: TrainState) -> TrainState:
    engine, spec = ctx.engine, ctx.spec

    while st.step < spec.train.steps:
        step = st.step
        ctx.comm.take()  # collectives outside the step (checkpoints, rollbacks) are not its comm time
        t0 = time.perf_counter()
        ctx.faults.act(step, ctx.run)  # an injected crash, hang or slow rank (tests and demos)
        lr = float(engine.get_lr()[0])

        # --- micro-steps (data, forward, backward), then the boundary all-reduce ------------------------
        m, agreed = execute(ctx, st, step)

        # --- a step judged bad at the boundary (a NaN, a spike) is held and replayed once ---------------
        if agreed.oom_rank is None and (bad := ctx.judge.judge(agreed.losses, agreed.all_finite)):
            m, agreed = replay.settle(ctx, st, step, bad, agreed)
        pos = st.data_position  # a step whose data the replay skipped ran on the next data
        comm_spans = ctx.comm.take_spans()  # read after the step's sync point
        if agreed.oom_rank is not None:  # the split step ran out of memory too: save and halt
            halt_out_of_memory(ctx, st, step, agreed.oom_rank)
            handle_commands(ctx, st, agreed.agreed_seq)  # halted: wait for a resume, rollback or cancel
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
            ctx.judge.add(step, agreed.losses)

        # --- emit -----------------------------------------------------------------------------------------
        times = StepTimes(t0, t_end, (te, tf), comm_spans)
        report_step(ctx, st, step, pos, m, agreed, lr=lr, applied=applied, times=times)
        st.step, st.data_position = step + 1, next_position(pos, st.skip_windows)

        # --- checkpoint ---------------------------------------------------------------------------------
        saved = st.step % spec.checkpoint.every == 0
        if saved:
            save_checkpoint(ctx, st)

        # --- in-memory snapshot: a host copy now, written and sent to the peer in the background ----------
        take_snapshot(ctx, st, t_end - t0, pin=saved)  # a disk checkpoint's step stays in the process too

        # --- preemption: every rank saves where it stands, then exits (the job is requeued) --------------
        if agreed.preempt:
            save_emergency_checkpoint(ctx, st, "preemption notice")
            st.preempted = True
            return st

        # --- commands agreed at this boundary -------------------------------------------------------------
        if agreed.agreed_seq > st.handled_seq:
            handle_commands(ctx, st, agreed.agreed_seq)
    return st
