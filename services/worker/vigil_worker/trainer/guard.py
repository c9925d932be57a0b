"""The finiteness guard and command boundary: one small all-reduce before each optimizer step, the
SDK's (`vigil.boundary`: all finite?, the highest command any rank has, out of memory, preemption, and
every rank's loss for the step).

A non-finite update then leaves the weights alone: ZeRO stages and bf16/fp16 already skip a step whose
gradient norm is not finite; plain fp32 without ZeRO steps our optimizer directly, so the
guard tells `GuardedAdamW` to skip (DeepSpeed reads the same flag to count the step as skipped and
leave the LR schedule where it is).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple

import torch

from vigil import boundary

if TYPE_CHECKING:
    from vigil_worker.trainer.context import RankContext


def guards_optimizer(ctx: RankContext) -> bool:
    """True where DeepSpeed steps our optimizer directly (fp32 without ZeRO), so the skip is ours to make."""
    return ctx.zero_stage == 0 and ctx.precision == "fp32"


def agree(
    ctx: RankContext,
    finite: torch.Tensor,
    loss: torch.Tensor,
    *,
    oom: bool = False,
    preempt: bool = False,
) -> Boundary:
    """All ranks: is the update finite everywhere, which commands have arrived, did any rank run out of
    memory, is any node preempted, and what was every rank's loss (the SDK's boundary)? `finite` is this
    rank's 1.0 or 0.0 for its losses, `loss` its loss for the step, `oom` and `preempt` its own news.
    Where the skip is ours (fp32 without ZeRO), the full gradients' norm joins the finiteness verdict and
    arms `GuardedAdamW`."""
    grad_norm: float | None = None
    if guards_optimizer(ctx):
        grads = [p.grad for p in ctx.engine.module.parameters() if p.grad is not None]
        norm = torch.nn.utils.get_total_norm(grads)  # full gradients after the all-reduce
        grad_norm = float(norm)
        finite = finite * torch.isfinite(norm).float()
    got = boundary.agree(
        finite,
        latest_seq=ctx.run.link.latest_seq,
        rank=ctx.rank,
        world_size=ctx.world_size,
        oom=oom,
        preempt=preempt,
        loss=loss,
    )
    if guards_optimizer(ctx):
        ctx.engine.optimizer.overflow = not got.all_finite
    return Boundary(got.all_finite, got.agreed_seq, grad_norm, got.oom_rank, got.preempt, got.losses or ())


class Boundary(NamedTuple):
    """What all ranks agreed on at a step boundary (the SDK's), with the trainer's grad norm."""

    all_finite: bool  # every rank's loss and gradients were finite
    agreed_seq: int  # the highest command sequence number any rank has received
    grad_norm: float | None  # the full gradients' norm, where the guard computes it (fp32 without ZeRO)
    oom_rank: int | None = None  # the lowest rank that ran out of memory in this step; None: none did
    preempt: bool = False  # some rank's node got a preemption notice
    losses: tuple[float, ...] = ()  # every rank's loss for the step, by rank (NaN: not finite)
