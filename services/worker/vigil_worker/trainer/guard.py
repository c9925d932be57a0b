"""The finiteness guard and command boundary: one small all-reduce before each optimizer step.

Before the step, all ranks all-reduce MIN over [all finite?, -commands seen, lowest rank out of
memory (the world size: none), preemption noticed? (0: yes)]. Every rank learns whether any rank saw a
non-finite loss or gradient (torchtitan's guard), the highest command sequence number any rank has
received, so that all ranks act on the same commands at the same step boundary, whether a rank ran out
of memory in this step (all retry it together, `oom`), and whether a rank's node is being preempted (all
write the emergency checkpoint together). One collective carries all four.

A non-finite update then leaves the weights alone: ZeRO stages and bf16/fp16 already skip a step whose
gradient norm is not finite; plain fp32 without ZeRO steps our optimizer directly, so the
guard tells `GuardedAdamW` to skip (DeepSpeed reads the same flag to count the step as skipped and
leave the LR schedule where it is).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, NamedTuple

import torch
import torch.distributed as dist

if TYPE_CHECKING:
    from vigil_worker.trainer.context import RankContext


class GuardedAdamW(torch.optim.AdamW):
    """AdamW that skips its step while `overflow` is set (DeepSpeed reads the same flag after the step)."""

    overflow = False

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        if self.overflow:
            return None
        return super().step(closure)


class Boundary(NamedTuple):
    """What all ranks agreed on at a step boundary."""

    all_finite: bool  # every rank's loss and gradients were finite
    agreed_seq: int  # the highest command sequence number any rank has received
    grad_norm: float | None  # the full gradients' norm, where the guard computes it (fp32 without ZeRO)
    oom_rank: int | None = None  # the lowest rank that ran out of memory in this step; None: none did
    preempt: bool = False  # some rank's node got a preemption notice


def guards_optimizer(ctx: RankContext) -> bool:
    """True where DeepSpeed steps our optimizer directly (fp32 without ZeRO), so the skip is ours to make."""
    return ctx.zero_stage == 0 and ctx.precision == "fp32"


def agree(ctx: RankContext, finite: torch.Tensor, *, oom: bool = False, preempt: bool = False) -> Boundary:
    """All ranks: is the update finite everywhere, which commands have arrived, did any rank run out of
    memory, is any node preempted? `finite` is this rank's 1.0 or 0.0 for its losses, `oom` and `preempt`
    its own news; arm `GuardedAdamW` to skip a non-finite update."""
    grad_norm: float | None = None
    if guards_optimizer(ctx):
        grads = [p.grad for p in ctx.engine.module.parameters() if p.grad is not None]
        norm = torch.nn.utils.get_total_norm(grads)  # full gradients after the all-reduce
        grad_norm = float(norm)
        finite = finite * torch.isfinite(norm).float()
    news = [-float(ctx.sink.latest_seq), float(ctx.rank if oom else ctx.world_size), 0.0 if preempt else 1.0]
    ctrl = torch.cat([finite.reshape(1), torch.tensor(news, device=ctx.device, dtype=finite.dtype)])
    dist.all_reduce(ctrl, op=dist.ReduceOp.MIN)
    got = ctrl.tolist()  # CPU-GPU sync point (the one per step)
    all_finite, agreed_seq, oom_rank = got[0] == 1.0, int(-got[1]), int(got[2])
    if guards_optimizer(ctx):
        ctx.engine.optimizer.overflow = not all_finite
    return Boundary(
        all_finite, agreed_seq, grad_norm, oom_rank if oom_rank < ctx.world_size else None, got[3] == 0.0
    )
