"""The training loop of one rank, in nanoGPT's shape: one function, sections in order.

Per step: data, forward, backward (DeepSpeed reduces gradients at the accumulation boundary), one small
control all-reduce (finiteness guard and command boundary), optimizer step, log and emit, checkpoint,
then any command all ranks agreed on. Setup (process group, engine, data, sink) is `rank.py`'s.
"""

from __future__ import annotations

import logging
import time

import torch

from vigil_common import events as ev
from vigil_common import subjects
from vigil_worker.trainer import guard
from vigil_worker.trainer.checkpoint_collective import save_checkpoint
from vigil_worker.trainer.commands import handle_commands
from vigil_worker.trainer.context import RankContext, TrainState
from vigil_worker.trainer.data import batch, next_position
from vigil_worker.trainer.memory import memory_bytes

log = logging.getLogger("vigil.rank")


def train(ctx: RankContext, st: TrainState) -> TrainState:
    engine, spec = ctx.engine, ctx.spec
    T, B, accum = spec.model.resolved().seq_len, spec.train.micro_batch, spec.train.grad_accum
    tokens_per_step = B * T * accum
    cuda = ctx.device.type == "cuda"

    def sync() -> None:  # CPU-GPU sync point: section timings on GPU are honest only after one
        if cuda:
            torch.cuda.synchronize()

    while st.step < spec.train.steps:
        step, pos = st.step, st.data_position
        ctx.comm.take()  # collectives outside the step (checkpoints, rollbacks) are not its comm time
        t0 = time.perf_counter()
        ctx.faults.act(step, ctx.sink)  # an injected crash, hang or slow rank (tests and demos)
        factor = ctx.faults.loss_factor(step)
        lr = float(engine.get_lr()[0])
        t_data = t_fwd = t_bwd = 0.0
        loss_sum = torch.zeros((), device=ctx.device)
        finite = torch.ones((), device=ctx.device)

        for micro in range(accum):
            # --- data: a pure function of (seed, data position, rank, micro-step) -----------------------
            ta = time.perf_counter()
            x, y = batch(
                ctx.tokens,
                seed=spec.train.seed,
                data_position=pos,
                rank=ctx.rank,
                micro=micro,
                micro_batch=B,
                seq_len=T,
            )  # (B, T) each
            x, y = x.to(ctx.device, non_blocking=True), y.to(ctx.device, non_blocking=True)
            tb = time.perf_counter()
            # --- forward ------------------------------------------------------------------------------
            loss = engine(x, y)
            if factor != 1.0:
                loss = loss * factor  # injected NaN or spike: flows into the gradients like a real one
            sync()
            tc = time.perf_counter()
            # --- backward (at the accumulation boundary DeepSpeed reduces the gradients: comm) --------
            engine.backward(loss)
            if micro < accum - 1:
                engine.step()  # not the boundary: DeepSpeed only counts the micro-step (no update)
            sync()
            td = time.perf_counter()
            t_data, t_fwd, t_bwd = t_data + tb - ta, t_fwd + tc - tb, t_bwd + td - tc
            loss_sum += loss.detach().float()
            finite = finite * torch.isfinite(loss.detach()).float()

        # --- finiteness guard and command boundary: one small all-reduce -------------------------------
        # every rank learns whether any rank saw a non-finite loss or gradient, and the highest command
        # any rank has received, so that all act on the same commands at this same step boundary
        agreed = guard.agree(ctx, finite)  # `finite` stays this rank's own: the event names who made a NaN
        comm_s = ctx.comm.take()

        # --- optimizer step at the accumulation boundary (skipped when the update is not finite) -------
        te = time.perf_counter()
        engine.step()
        sync()
        tf = time.perf_counter()
        applied = bool(engine.was_step_applied())
        ctx.observer.on_step_end(step, tf - t0)
        if not agreed.all_finite and applied:
            raise RuntimeError(f"step {step}: a non-finite update was applied; refusing to go on")

        # --- log and emit -------------------------------------------------------------------------------
        loss_value = loss_sum.item() / accum  # CPU-GPU sync point (once per step)
        grad_norm = agreed.grad_norm
        if grad_norm is None:
            gn = engine.get_global_grad_norm()
            grad_norm = float(gn) if gn is not None else None
        step_s = tf - t0
        ctx.sink.emit(
            subjects.step(ctx.job_id),
            ev.StepCompleted(
                job_id=ctx.job_id,
                attempt=ctx.attempt,
                rank=ctx.rank,
                node=ctx.node,
                step=step,
                loss=loss_value,
                grad_norm=grad_norm,
                lr=lr,
                tokens=tokens_per_step,
                tokens_per_s=tokens_per_step / step_s if step_s > 0 else 0.0,
                data_time_s=t_data,
                forward_time_s=t_fwd,
                backward_time_s=t_bwd,
                comm_time_s=comm_s,
                optimizer_time_s=tf - te,
                step_time_s=step_s,
                skipped=not applied,
                data_position=pos,
                local_finite=bool(finite.item()),  # already computed: the guard's .item() synchronised
                **memory_bytes(ctx.device),
            ),
        )
        if step % 10 == 0 or not applied:
            log.info(
                "step %d loss %.4f lr %.2e %s%.0f ms (comm %.0f ms)",
                step,
                loss_value,
                lr,
                "SKIPPED " if not applied else "",
                1000 * step_s,
                1000 * comm_s,
            )
        st.step, st.data_position = step + 1, next_position(pos, st.skip_windows)

        # --- checkpoint ---------------------------------------------------------------------------------
        if st.step % spec.checkpoint.every == 0:
            save_checkpoint(ctx, st)

        # --- commands agreed at this boundary -------------------------------------------------------------
        if agreed.agreed_seq > st.handled_seq:
            handle_commands(ctx, st, agreed.agreed_seq)
    return st
