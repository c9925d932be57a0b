"""Out of memory in a step: keep every rank's collectives in line, then retry with half the micro-batch.

A rank that runs out of memory (`torch.OutOfMemoryError`) in a micro-step cannot just stop: the other
ranks go on into the backward passes whose gradient reductions it must join. So it frees what it can and
stands in for its remaining micro-steps with a backward of NaN * (sum of the weights): no activations,
the same hooks and reductions, and gradients that are NaN everywhere once reduced. The step boundary's
all-reduce (`guard.agree`) then tells every rank that rank r ran out of memory; the update is dropped as
any non-finite one is (the SDK's `skip_step`), and all ranks retry the same step, with
the same data, split into twice as many micro-steps of half the size (`split`): the global batch, and
the tokens each rank reads, do not change. Once split, a job stays split; a second out-of-memory is the
end: the caller writes the emergency checkpoint and halts the job with an `oom` incident.

Limit: an out-of-memory in the middle of a backward under ZeRO-2/3 (whose reductions run inside the
backward, bucket by bucket) leaves a partial bucket behind; this recovery is exact where the reductions
run after the backward (no ZeRO, ZeRO-1) or the error comes in the forward.
"""

from __future__ import annotations

import gc
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeVar

import torch

from vigil import events as ev
from vigil.integrations.deepspeed import skip_step
from vigil_trainer.checkpoint_collective import save_emergency_checkpoint

if TYPE_CHECKING:
    from vigil.boundary import Boundary
    from vigil_trainer.context import RankContext, TrainState

log = logging.getLogger("vigil.rank")
M = TypeVar("M")

MAX_SPLIT = 2  # retry once, with half the micro-batch


def null_backward(engine: Any) -> None:
    """A backward with no activations whose gradients are NaN: joins the step's reductions, poisons it."""
    params = [p for p in engine.module.parameters() if p.requires_grad]
    loss = torch.stack([p.sum() for p in params]).sum() * float("nan")
    engine.backward(loss)


def free_memory(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def can_split(micro_batch: int, split: int) -> bool:
    """True when the spec's micro-batch can be cut into 2 * `split` equal parts within MAX_SPLIT."""
    return split * 2 <= MAX_SPLIT and micro_batch % (split * 2) == 0


def apply_split(engine: Any, micro_batch: int, grad_accum: int, world_size: int, split: int) -> None:
    """Tell DeepSpeed: micro-batches of micro_batch / split, split x the accumulation, same global batch."""
    engine.set_train_micro_batch_size(micro_batch // split)
    engine.set_train_batch_size(micro_batch * grad_accum * world_size)


def with_retry(
    ctx: RankContext, st: TrainState, step: int, execute: Callable[[], tuple[M, Boundary]]
) -> tuple[M, Boundary]:
    """Run the step's micro-steps and boundary (`execute`); where a rank ran out of memory, skip the
    poisoned update and run them again split in two. The boundary's `oom_rank` is still set when the
    split run ran out of memory too (the caller halts: `halt_out_of_memory`)."""
    B, accum = ctx.spec.train.micro_batch, ctx.spec.train.grad_accum
    while True:
        m, agreed = execute()
        if agreed.oom_rank is None:
            return m, agreed
        skip_step(ctx.engine)  # the accumulation boundary: the poisoned update is dropped
        free_memory(ctx.device)
        if not can_split(B, st.split):
            return m, agreed
        st.split *= 2
        apply_split(ctx.engine, B, accum, ctx.run.identity.world_size, st.split)
        log.warning(
            "step %d: rank %d ran out of memory; retrying with micro-batch %d x %d accumulation",
            step,
            agreed.oom_rank,
            B // st.split,
            accum * st.split,
        )


def halt_out_of_memory(ctx: RankContext, st: TrainState, step: int, oom_rank: int) -> None:
    """The retry ran out of memory too: every rank writes the emergency checkpoint and halts (the SDK's
    `Run.halt`); rank 0 reports it (`OutOfMemoryHalted`), which the guardian records as the `oom`
    incident."""
    save_emergency_checkpoint(ctx, st, "out of memory")
    who = ctx.run.identity
    incident_id = f"oom-{who.job_id}-{who.attempt}-{step}"
    reason = (
        f"rank {oom_rank} ran out of memory at step {step} with micro-batch "
        f"{ctx.spec.train.micro_batch // st.split}; halted after the emergency checkpoint of step {st.step}"
    )
    if who.rank == 0:
        ctx.run.emit(
            ev.OutOfMemoryHalted(
                event_id=incident_id,
                job_id=who.job_id,
                attempt=who.attempt,
                step=step,
                rank=oom_rank,
                node=who.node,
                micro_batch=ctx.spec.train.micro_batch // st.split,
                grad_accum=ctx.spec.train.grad_accum * st.split,
                checkpoint_step=st.step,
                message=reason,
            )
        )
    ctx.run.halt(reason, incident_id)  # the loop's `after_step` then waits for a resume, rollback or cancel
