"""A step's micro-steps on one rank: data, forward, backward, `grad_accum` x `split` times.

The data is a pure function of (seed, data position, rank, micro-step), so running the same position
again (a replay) reads the same rows. Out of memory, the rank stands in for its remaining micro-steps
with `oom.null_backward`, so its reductions stay in line with the other ranks'.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

import torch

from vigil.boundary import Boundary
from vigil_trainer import guard
from vigil_trainer.context import RankContext, TrainState
from vigil_trainer.data import batch
from vigil_trainer.oom import free_memory, null_backward, with_retry

log = logging.getLogger("vigil.rank")


@dataclass
class MicroSteps:
    """What one pass over a step's micro-steps leaves for the boundary."""

    loss_sum: torch.Tensor  # sum of the micro-steps' losses, on the device
    count: int  # micro-steps (grad_accum x split): loss_sum / count is the step's loss
    finite: torch.Tensor  # 1.0 when every one of this rank's losses was finite, else 0.0
    oom: bool = False  # this rank ran out of memory (the rest of its micro-steps were stand-ins)
    spans: dict[str, list[tuple[Any, Any]]] = field(default_factory=dict)  # phase -> clock marks
    grad_norm: torch.Tensor | None = None  # the full gradients' norm, where the guard computes it (no ZeRO)

    @property
    def loss(self) -> torch.Tensor:
        """The step's loss on this rank (the mean over its micro-steps), on the device."""
        return self.loss_sum / self.count

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
    m = MicroSteps(
        loss_sum=torch.zeros((), device=ctx.device), count=n, finite=torch.ones((), device=ctx.device)
    )
    for micro in range(n):
        if m.oom:
            null_backward(engine)
        else:
            try:
                # --- data: a pure function of (seed, data position, rank, micro-step); a split micro-step
                # reads its part of the same rows; an elastic job at another size, the spec's rank's ---------
                ta = clock.now()
                rank, source = ctx.run.identity.rank, micro // split
                if ctx.shape is not None and ctx.shape.resized:  # elastic: the spec-size rank's batch
                    rank, source = ctx.shape.source(rank, source)
                x, y = batch(
                    ctx.tokens,
                    seed=spec.train.seed,
                    data_position=pos,
                    rank=rank,
                    micro=source,
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
                loss = engine(x, y)  # bf16 without ZeRO: under DeepSpeed's torch_autocast
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


def execute(ctx: RankContext, st: TrainState, step: int) -> tuple[MicroSteps, Boundary]:
    """Step `step` on the data at `st.data_position`: its micro-steps, then the boundary all-reduce;
    where a rank ran out of memory, again split in two (`oom.with_retry`)."""
    pos = st.data_position
    factor = ctx.faults.loss_factor(step, pos)  # an injected NaN or spike (tests and demos)

    def once() -> tuple[MicroSteps, Boundary]:
        m = micro_steps(ctx, st, step, pos, factor)
        # every rank learns whether any rank saw a non-finite loss or gradient or ran out of memory, the
        # highest command any rank has received, whether any rank's node is being preempted, and every
        # rank's loss, so that all act on the same news at this same step boundary
        return m, guard.agree(ctx, m)

    return with_retry(ctx, st, step, once)
