"""Checkpoints as all ranks take them together, with DeepSpeed's engine, through the SDK as any program:
saving (`Run.save_checkpoint` writes the manifest and reports it), the emergency checkpoint, and the
loader a rollback or a relaunch calls with the chosen folder (`Run.on_rollback`, `Run.resume_checkpoint`:
rank 0 verifies it, all load the same).
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

from vigil import manifest
from vigil.errors import CheckpointError
from vigil.integrations import ds_compat
from vigil_trainer import checkpoint as ckpt
from vigil_trainer.context import RankContext, TrainState

log = logging.getLogger("vigil.rank")


def save_checkpoint(ctx: RankContext, st: TrainState) -> None:
    """All ranks save their DeepSpeed shards; rank 0 then writes the manifest (last), prunes and reports
    it: the SDK's `Run.save_checkpoint` around `engine.save_checkpoint`."""
    ctx.run.save_checkpoint(
        st.step,
        lambda path: ctx.engine.save_checkpoint(str(path), tag=ckpt.DS_TAG, save_latest=False),
        data_position=st.data_position,
    )
    st.saved_step = st.step


def save_emergency_checkpoint(ctx: RankContext, st: TrainState, why: str) -> float:
    """All ranks: the checkpoint of where training stands now, before the job stops (preemption, or an
    out-of-memory the retry did not cure), unless this very step is saved already. Returns the seconds
    it took (a preemption's grace period must cover them)."""
    t0 = time.perf_counter()
    if st.saved_step != st.step:
        save_checkpoint(ctx, st)
    seconds = time.perf_counter() - t0
    log.warning("emergency checkpoint at step %d (%s) in %.2fs", st.step, why, seconds)
    return seconds


def load_checkpoint(ctx: RankContext, path: Path) -> None:
    """Load the verified checkpoint folder `path` in place into the running engine (the run's loader); one
    saved by another number of ranks (an elastic job that shrank or grew) is re-partitioned."""
    try:
        if saved_at := ds_compat.saved_at_another_size(ctx.engine, str(path), ckpt.DS_TAG):  # elastic
            log.warning(
                "checkpoint %s: saved by %d ranks, re-partitioned to %d",
                path,
                saved_at,
                ctx.run.identity.world_size,
            )
            ds_compat.load_resized_checkpoint(ctx.engine, str(path), ckpt.DS_TAG)
            return
        loaded, _ = ctx.engine.load_checkpoint(
            str(path), tag=ckpt.DS_TAG, load_optimizer_states=True, load_lr_scheduler_states=True
        )
        if loaded is None:
            raise CheckpointError(f"DeepSpeed could not load {path}")
    except Exception as exc:
        # It verified against its manifest and still did not load (rewritten with its manifest, or
        # written wrong): marked bad, so the relaunch that follows this rank's exit takes an older one.
        log.error("checkpoint %s did not load: %s", path, exc)
        ctx.run.refuse_checkpoint(path, manifest.step_of(path) or 0, "load", exc)
        raise CheckpointError(f"checkpoint {path} verified but did not load: {exc}") from exc
