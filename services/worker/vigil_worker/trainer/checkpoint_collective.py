"""Checkpoints as all ranks take them together: save, choose and load, with the collectives between.

Saving: every rank writes its DeepSpeed shards, then rank 0 writes the manifest (last) and prunes.
Loading: rank 0 verifies the checkpoint asked for (or falls back to the newest valid one before it)
and broadcasts its choice, so every rank loads the same one in place. The files and the manifest
themselves are `checkpoint`'s.
"""

from __future__ import annotations

import logging
import shutil
import time
from typing import Any

import torch.distributed as dist

from vigil_common import events as ev
from vigil_common import subjects
from vigil_common.errors import CheckpointError
from vigil_worker.trainer import checkpoint as ckpt
from vigil_worker.trainer.context import RankContext, TrainState
from vigil_worker.trainer.data import first_position

log = logging.getLogger("vigil.rank")


def save_checkpoint(ctx: RankContext, st: TrainState) -> None:
    """All ranks save their shards with DeepSpeed; rank 0 then writes the manifest (last) and prunes."""
    path = ckpt.step_dir(ctx.checkpoint_root, ctx.job_id, st.step)
    if ctx.rank == 0 and path.exists():  # an older timeline's checkpoint of this step (after a rollback)
        shutil.rmtree(path)
    dist.barrier()
    ctx.engine.save_checkpoint(str(path), tag=ckpt.DS_TAG, save_latest=False)
    dist.barrier()  # every rank's files are on disk
    if ctx.rank == 0:
        m = ckpt.write_manifest(
            path,
            job_id=ctx.job_id,
            step=st.step,
            data_position=st.data_position,
            skip_windows=st.skip_windows,
        )
        ckpt.retain(ctx.checkpoint_root, ctx.job_id, ctx.spec.checkpoint.keep)
        ctx.sink.emit(
            subjects.status(ctx.job_id),
            ev.CheckpointSaved(
                job_id=ctx.job_id,
                attempt=ctx.attempt,
                step=st.step,
                path=str(path),
                bytes=m.bytes,
                manifest_sha256=m.sha256,
                data_position=st.data_position,
            ),
        )
        log.info("checkpoint step %d saved: %s (%d bytes)", st.step, path, m.bytes)
    dist.barrier()  # nobody races ahead into a rollback while the manifest is being written
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


def choose_checkpoint(ctx: RankContext, requested: str, requested_step: int | None) -> ckpt.Manifest:
    """Rank 0 verifies the requested checkpoint; if it is corrupt or outside this job's own folder (a
    command naming another job's checkpoint), the newest valid one of this job before `requested_step`
    (None: before any step). Every rank gets rank 0's choice, so all load the same checkpoint."""
    choice: list[Any] = [None, ""]
    if ctx.rank == 0:
        try:
            choice[0] = ckpt.verify(requested, root=ckpt.job_dir(ctx.checkpoint_root, ctx.job_id))
        except CheckpointError as exc:
            log.error("refusing checkpoint %s: %s", requested, exc)
            before = None if requested_step is None else requested_step - 1
            choice[0] = ckpt.newest_valid(ctx.checkpoint_root, ctx.job_id, at_or_before=before)
            choice[1] = str(exc)
            if choice[0] is not None:
                log.warning("using the newest valid earlier checkpoint instead: %s", choice[0].path)
    dist.broadcast_object_list(choice, src=0)
    if choice[0] is None:
        where = "" if requested_step is None else f" at or before step {requested_step}"
        raise CheckpointError(f"no valid checkpoint{where}: {choice[1]}")
    return choice[0]


def load_checkpoint(ctx: RankContext, st: TrainState, m: ckpt.Manifest) -> float:
    """Load `m` in place into the running engine and move `st` to it; returns DeepSpeed's load time in
    seconds."""
    t0 = time.perf_counter()
    loaded, _ = ctx.engine.load_checkpoint(
        str(m.path), tag=ckpt.DS_TAG, load_optimizer_states=True, load_lr_scheduler_states=True
    )
    if loaded is None:
        raise CheckpointError(f"DeepSpeed could not load {m.path}")
    seconds = time.perf_counter() - t0
    st.step, st.skip_windows = m.step, list(m.skip_windows)
    st.data_position = first_position(m.data_position, st.skip_windows)
    return seconds
