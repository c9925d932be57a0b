"""The finiteness guard at the step boundary: the SDK's one small all-reduce before each optimizer step
(`Run.agree`: all finite?, the highest command any rank has, out of memory, preemption, and every
rank's loss for the step).

A non-finite update is then dropped on every rank by the SDK's one skip (`skip_step` of
`vigil.integrations.deepspeed`, in `loop`). Without ZeRO (fp32, or bf16 as autocast over fp32 weights)
DeepSpeed steps our optimizer directly and checks nothing, so the gradients' norm joins the verdict
here, and the guard clips the gradients with it (DeepSpeed's `gradient_clipping` is 0 there: one norm
per step, not two).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from vigil.boundary import Boundary

if TYPE_CHECKING:
    from vigil_trainer.context import RankContext
    from vigil_trainer.micro import MicroSteps


def agree(ctx: RankContext, m: MicroSteps) -> Boundary:
    """All ranks: is the update finite everywhere, which commands have arrived, did any rank run out of
    memory, is any node preempted, and what was every rank's loss? Where the step is ours (no ZeRO), the
    full gradients' norm joins the finiteness verdict, clips the gradients and goes into `m.grad_norm`:
    computed once, on the device, read after the step's sync."""
    finite = m.finite
    params: list[torch.nn.Parameter] = []
    if ctx.owns_step:
        params = [p for p in ctx.engine.module.parameters() if p.grad is not None]
        # the full gradients' norm after the all-reduce, on the device (no host sync)
        m.grad_norm = torch.nn.utils.get_total_norm([p.grad for p in params])
        finite = finite * torch.isfinite(m.grad_norm).float()
    got = ctx.run.agree(finite, oom=m.oom, loss=m.loss)
    clip = ctx.spec.train.grad_clip
    if ctx.owns_step and got.all_finite and clip > 0 and m.grad_norm is not None:
        # DeepSpeed's clipping is off here; this takes parameters (it scales their .grad)
        torch.nn.utils.clip_grads_with_norm_(params, clip, m.grad_norm)
    return got
