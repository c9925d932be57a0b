"""The training loop of one rank, in nanoGPT's shape: one function, sections in order.

Per step: data, forward, backward (DeepSpeed reduces gradients at the accumulation boundary), one small
control all-reduce (finiteness guard, out-of-memory, preemption and command boundary), optimizer step,
log and emit, checkpoint, the emergency checkpoint on a preemption notice, then any command all ranks
agreed on. A step that runs out of memory is tried again with half the micro-batch (`oom`). Setup
(process group, engine, data, sink) is `rank.py`'s.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from vigil_common import events as ev
from vigil_worker.trainer import guard
from vigil_worker.trainer.checkpoint_collective import save_checkpoint, save_emergency_checkpoint
from vigil_worker.trainer.commands import halt, handle_commands
from vigil_worker.trainer.context import RankContext, TrainState
from vigil_worker.trainer.data import batch, next_position
from vigil_worker.trainer.memory import memory_bytes
from vigil_worker.trainer.mfu import mfu
from vigil_worker.trainer.oom import apply_split, can_split, free_memory, null_backward

log = logging.getLogger("vigil.rank")


def train(ctx: RankContext, st: TrainState) -> TrainState:
    engine, spec = ctx.engine, ctx.spec
    T, B, accum = spec.model.resolved().seq_len, spec.train.micro_batch, spec.train.grad_accum
    tokens_per_step = B * T * accum  # the same after an out-of-memory split: B / split x accum * split

    while st.step < spec.train.steps:
        step, pos = st.step, st.data_position
        ctx.comm.take()  # collectives outside the step (checkpoints, rollbacks) are not its comm time
        t0 = time.perf_counter()
        ctx.faults.act(step, ctx.run)  # an injected crash, hang or slow rank (tests and demos)
        factor = ctx.faults.loss_factor(step)
        lr = float(engine.get_lr()[0])

        while True:
            # --- micro-steps: data, forward, backward -------------------------------------------------------
            m = micro_steps(ctx, st, step, pos, factor)

            # --- finiteness guard and command boundary: one small all-reduce --------------------------------
            # every rank learns whether any rank saw a non-finite loss or gradient or ran out of memory, the
            # highest command any rank has received, and whether any rank's node is being preempted, so
            # that all act on the same news at this same step boundary
            agreed = guard.agree(ctx, m.finite, oom=m.oom, preempt=ctx.notice.requested)
            if agreed.oom_rank is None:
                break
            # --- out of memory somewhere: skip the poisoned update, then retry the step split ---------------
            engine.step()  # the accumulation boundary: DeepSpeed skips a non-finite update
            free_memory(ctx.device)
            if not can_split(B, st.split):
                break
            st.split *= 2
            apply_split(engine, B, accum, ctx.world_size, st.split)
            log.warning(
                "step %d: rank %d ran out of memory; retrying with micro-batch %d x %d accumulation",
                step,
                agreed.oom_rank,
                B // st.split,
                accum * st.split,
            )
        comm_spans = ctx.comm.take_spans()  # read after the step's sync point
        if agreed.oom_rank is not None:  # the split step ran out of memory too: save and halt
            halt_out_of_memory(ctx, st, step, agreed.oom_rank)
            handle_commands(ctx, st, agreed.agreed_seq)  # halted: wait for a resume, rollback or cancel
            continue

        # --- optimizer step at the accumulation boundary (skipped when the update is not finite) -------
        te = ctx.clock.now()
        engine.step()
        tf = ctx.clock.now()
        ctx.clock.sync()  # CPU-GPU sync point, the step's one: every phase's marks are readable after it
        t_end = time.perf_counter()
        applied = bool(engine.was_step_applied())
        ctx.observer.on_step_end(step, t_end - t0)
        if not agreed.all_finite and applied:
            raise RuntimeError(f"step {step}: a non-finite update was applied; refusing to go on")

        # --- log and emit -------------------------------------------------------------------------------
        loss_value = m.loss_sum.item() / (accum * st.split)  # synchronised already: no wait
        t_data, t_fwd, t_bwd = (m.seconds(ctx, phase) for phase in ("data", "forward", "backward"))
        comm_s = ctx.comm.total(comm_spans)
        grad_norm = agreed.grad_norm
        if grad_norm is None:
            gn = engine.get_global_grad_norm()
            grad_norm = float(gn) if gn is not None else None
        step_s = t_end - t0
        tokens_per_s = tokens_per_step / step_s if step_s > 0 else 0.0
        ctx.run.emit(
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
                tokens_per_s=tokens_per_s,
                data_time_s=t_data,
                forward_time_s=t_fwd,
                backward_time_s=t_bwd,
                comm_time_s=comm_s,
                optimizer_time_s=ctx.clock.between(te, tf),
                step_time_s=step_s,
                skipped=not applied,
                data_position=pos,
                local_finite=bool(m.finite.item()),  # already computed: the guard's .tolist() synchronised
                flops_per_token=ctx.flops_per_token,
                mfu=mfu(tokens_per_s, ctx.flops_per_token, ctx.peak) if ctx.flops_per_token else None,
                micro_batch=B // st.split,
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

        # --- preemption: every rank saves where it stands, then exits (the job is requeued) --------------
        if agreed.preempt:
            save_emergency_checkpoint(ctx, st, "preemption notice")
            st.preempted = True
            return st

        # --- commands agreed at this boundary -------------------------------------------------------------
        if agreed.agreed_seq > st.handled_seq:
            handle_commands(ctx, st, agreed.agreed_seq)
    return st


@dataclass
class MicroSteps:
    """What one pass over a step's micro-steps leaves for the boundary."""

    loss_sum: torch.Tensor  # sum of the micro-steps' losses, on the device
    finite: torch.Tensor  # 1.0 when every one of this rank's losses was finite, else 0.0
    oom: bool = False  # this rank ran out of memory (the rest of its micro-steps were stand-ins)
    spans: dict[str, list[tuple[Any, Any]]] = field(default_factory=dict)  # phase -> clock marks

    def mark(self, phase: str, start: Any, end: Any) -> None:
        self.spans.setdefault(phase, []).append((start, end))

    def seconds(self, ctx: RankContext, phase: str) -> float:
        """A phase's seconds over the micro-steps (read after the step's sync point)."""
        return sum(ctx.clock.between(a, b) for a, b in self.spans.get(phase, []))


def micro_steps(ctx: RankContext, st: TrainState, step: int, pos: int, factor: float) -> MicroSteps:
    """Forward and backward over the step's micro-steps (`grad_accum` x `split` of them). Out of memory,
    the rank stands in for its remaining ones with `null_backward`, so its reductions stay in line."""
    engine, spec = ctx.engine, ctx.spec
    T, B, split = spec.model.resolved().seq_len, spec.train.micro_batch, st.split
    n = spec.train.grad_accum * split
    clock = ctx.clock
    m = MicroSteps(loss_sum=torch.zeros((), device=ctx.device), finite=torch.ones((), device=ctx.device))
    for micro in range(n):
        if m.oom:
            null_backward(engine)
        else:
            try:
                # --- data: a pure function of (seed, data position, rank, micro-step); a split micro-step
                # reads its part of the same rows ----------------------------------------------------------
                ta = clock.now()
                x, y = batch(
                    ctx.tokens,
                    seed=spec.train.seed,
                    data_position=pos,
                    rank=ctx.rank,
                    micro=micro // split,
                    micro_batch=B,
                    seq_len=T,
                    part=micro % split,
                    parts=split,
                )  # (B / split, T) each
                x, y = x.to(ctx.device, non_blocking=True), y.to(ctx.device, non_blocking=True)
                tb = clock.now()
                # --- forward --------------------------------------------------------------------------------
                if micro == 0 and ctx.faults.out_of_memory(step):
                    raise torch.OutOfMemoryError(f"injected out-of-memory at step {step}")
                loss = engine(x, y)
                if factor != 1.0:
                    loss = loss * factor  # injected NaN or spike: flows into the gradients like a real one
                tc = clock.now()
                # --- backward (at the accumulation boundary DeepSpeed reduces the gradients: comm) ----------
                engine.backward(loss)
                td = clock.now()
                m.mark("data", ta, tb)
                m.mark("forward", tb, tc)
                m.mark("backward", tc, td)
                m.loss_sum += loss.detach().float()
                m.finite = m.finite * torch.isfinite(loss.detach()).float()
            except torch.OutOfMemoryError as exc:
                log.error("step %d micro-step %d: out of memory (%s)", step, micro, exc)
                m.oom = True
                m.finite = torch.zeros((), device=ctx.device)
                loss = x = y = None  # drop the references before freeing
                free_memory(ctx.device)
                null_backward(engine)
        if micro < n - 1:
            engine.step()  # not the boundary: DeepSpeed only counts the micro-step (no update)
    return m


def halt_out_of_memory(ctx: RankContext, st: TrainState, step: int, oom_rank: int) -> None:
    """The retry ran out of memory too: every rank writes the emergency checkpoint and halts; rank 0
    reports it (`OutOfMemoryHalted`), which the guardian records as the `oom` incident."""
    save_emergency_checkpoint(ctx, st, "out of memory")
    incident_id = f"oom-{ctx.job_id}-{ctx.attempt}-{step}"
    reason = (
        f"rank {oom_rank} ran out of memory at step {step} with micro-batch "
        f"{ctx.spec.train.micro_batch // st.split}; halted after the emergency checkpoint of step {st.step}"
    )
    if ctx.rank == 0:
        ctx.run.emit(
            ev.OutOfMemoryHalted(
                event_id=incident_id,
                job_id=ctx.job_id,
                attempt=ctx.attempt,
                step=step,
                rank=oom_rank,
                node=ctx.node,
                micro_batch=ctx.spec.train.micro_batch // st.split,
                grad_accum=ctx.spec.train.grad_accum * st.split,
                checkpoint_step=st.step,
                message=reason,
            )
        )
    halt(ctx, st, reason, incident_id)
