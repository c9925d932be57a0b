"""The finiteness guard and command boundary: one small all-reduce before each optimizer step, the
SDK's (`vigil.boundary`: all finite?, the highest command any rank has, out of memory, preemption, and
every rank's loss for the step).

A non-finite update is then dropped on every rank by the SDK's one skip (`skip_step` of
`vigil.integrations.deepspeed`, in `loop`). Without ZeRO (fp32, or bf16 as autocast over fp32 weights)
DeepSpeed steps our optimizer directly and checks nothing, so the gradients' norm joins the verdict
here, and the guard clips the gradients with it (DeepSpeed's `gradient_clipping` is 0 there: one norm
per step, not two).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple

import torch

from vigil import boundary

if TYPE_CHECKING:
    from vigil_worker.trainer.context import RankContext


def guards_optimizer(ctx: RankContext) -> bool:
    """True where DeepSpeed steps our optimizer directly (no ZeRO, fp32 or bf16 autocast): the norm and the
    clip are ours to make."""
    return ctx.owns_step


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
    Where the step is ours (no ZeRO), the full gradients' norm joins the finiteness verdict and clips the
    gradients: computed once, on the device, read after the step's sync."""
    norm: torch.Tensor | None = None
    params: list[torch.nn.Parameter] = []
    if guards_optimizer(ctx):
        params = [p for p in ctx.engine.module.parameters() if p.grad is not None]
        # the full gradients' norm after the all-reduce, on the device (no host sync)
        norm = torch.nn.utils.get_total_norm([p.grad for p in params])
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
        clip = ctx.spec.train.grad_clip
        if got.all_finite and clip > 0 and norm is not None:
            # DeepSpeed's clipping is off here; this takes parameters (it scales their .grad)
            torch.nn.utils.clip_grads_with_norm_(params, clip, norm)
    return Boundary(got.all_finite, got.agreed_seq, norm, got.oom_rank, got.preempt, got.losses or ())


class Boundary(NamedTuple):
    """What all ranks agreed on at a step boundary (the SDK's), with the trainer's grad norm."""

    all_finite: bool  # every rank's loss and gradients were finite
    agreed_seq: int  # the highest command sequence number any rank has received
    grad_norm: torch.Tensor | None  # the full gradients' norm, where the guard computes it (no ZeRO)
    oom_rank: int | None = None  # the lowest rank that ran out of memory in this step; None: none did
    preempt: bool = False  # some rank's node got a preemption notice
    losses: tuple[float, ...] = ()  # every rank's loss for the step, by rank (NaN: not finite)
