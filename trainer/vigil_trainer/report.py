"""The step event: what one rank reports after each step (`Run.report`: a `StepCompleted`), and its log
line."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from vigil.boundary import Boundary
from vigil_trainer.context import RankContext, TrainState
from vigil_trainer.memory import memory_bytes
from vigil_trainer.mfu import mfu
from vigil_trainer.micro import MicroSteps

log = logging.getLogger("vigil.rank")


@dataclass
class StepTimes:
    """A step's marks: its start and end (perf_counter), the optimizer step's clock marks, the comm spans."""

    t0: float
    t_end: float
    optimizer: tuple[Any, Any]
    comm_spans: Any


def report_step(
    ctx: RankContext,
    st: TrainState,
    step: int,
    pos: int,
    m: MicroSteps,
    agreed: Boundary,
    *,
    lr: float,
    applied: bool,
    times: StepTimes,
) -> None:
    """Emit the step's event and, every 10 steps or when skipped, log it (read after the step's sync)."""
    spec = ctx.spec
    B = spec.train.micro_batch
    tokens = B * spec.model.resolved().seq_len * spec.train.grad_accum  # the same after a split
    rank = ctx.run.identity.rank
    loss = agreed.losses[rank] if agreed.losses else m.loss.item()  # synchronised already: no wait
    t_data, t_fwd, t_bwd = (m.seconds(ctx, phase) for phase in ("data", "forward", "backward"))
    comm_s = ctx.comm.total(times.comm_spans)
    if m.grad_norm is not None:
        grad_norm: float | None = float(m.grad_norm)  # computed by the guard, read after the sync
    else:
        gn = ctx.engine.get_global_grad_norm()
        grad_norm = float(gn) if gn is not None else None
    step_s = times.t_end - times.t0
    tokens_per_s = tokens / step_s if step_s > 0 else 0.0
    ctx.run.report(
        step,
        loss=loss,
        grad_norm=grad_norm,
        lr=lr,
        tokens=tokens,
        step_time_s=step_s,
        data_position=pos,
        skipped=not applied,
        local_finite=bool(m.finite.item()),  # already computed: the guard's .tolist() synchronised
        data_time_s=t_data,
        forward_time_s=t_fwd,
        backward_time_s=t_bwd,
        comm_time_s=comm_s,
        optimizer_time_s=ctx.clock.between(*times.optimizer),
        flops_per_token=ctx.flops_per_token,
        mfu=mfu(tokens_per_s, ctx.flops_per_token, ctx.peak) if ctx.flops_per_token else None,
        micro_batch=B // st.split,
        **memory_bytes(ctx.device),
    )
    if step % 10 == 0 or not applied:
        log.info(
            "step %d loss %.4f lr %.2e %s%.0f ms (comm %.0f ms)",
            step,
            loss,
            lr,
            "SKIPPED " if not applied else "",
            1000 * step_s,
            1000 * comm_s,
        )
