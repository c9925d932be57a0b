"""The built-in trainer's in-memory snapshots (`vigil.snapshot`): what one holds, when one is taken, and
loading one on a relaunch or an in-place rollback.

A rank's snapshot holds what its part of the disk checkpoint holds (`ds_compat.engine_state`: the
module, its ZeRO optimizer partition, the LR scheduler, the step counters) and the RNG; its manifest the
step, data position and skip windows. `checkpoint.memory_every` says how often ("auto": every step where
one costs under 2 % of it, else every N steps keeping it under 1 % per step; measured on the process's
first ones and agreed by all ranks).
Disk checkpoints stay as they are: a snapshot on /dev/shm does not outlive its node.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import torch

from vigil.integrations import ds_compat
from vigil.snapshot import (
    SnapshotManifest,
    Snapshots,
    auto_interval,
    deserialize,
    snapshot_folder_from_env,
    to_host,
)
from vigil_worker.trainer.context import RankContext, TrainState
from vigil_worker.trainer.data import first_position

log = logging.getLogger("vigil.rank")

AUTO_PROBE = 3  # "auto" takes this many snapshots in a process (every step), then agrees on its interval


def open_snapshots(ctx: RankContext, local_world: int) -> Snapshots | None:
    """Every rank together (the peer exchange's gloo group is made here): this rank's snapshots, or None
    when the spec turns them off or the engine is ZeRO-3 (its module is partitioned: not done yet)."""
    import torch.distributed as dist

    every = ctx.spec.checkpoint.memory_every
    if every == 0:
        return None
    if ctx.zero_stage == 3:
        log.warning("in-memory snapshots: off under ZeRO-3 (disk checkpoints only)")
        return None
    folder = snapshot_folder_from_env(ctx.job_id)
    group = None
    if ctx.world_size > 1 and dist.is_initialized():
        everywhere = torch.tensor([folder is not None], dtype=torch.int64, device=ctx.device)
        dist.all_reduce(everywhere, op=dist.ReduceOp.MIN)  # a node without a folder: none of them writes
        if not everywhere.item():
            folder = None
        else:
            group = dist.new_group(backend="gloo")  # the background thread's own, apart from training's
    snaps = Snapshots(
        folder,
        job_id=ctx.job_id,
        rank=ctx.rank,
        world=ctx.world_size,
        local_world=local_world,
        group=group,
        every=1 if every == "auto" else int(every),
    )
    if ctx.rank == 0:
        where = f"{folder.root}, peer copy on rank {snaps.partner}" if folder else "this process only"
        log.info("in-memory snapshots every %s step(s) (%s)", every, where)
    return snaps


def rank_state(ctx: RankContext) -> dict[str, Any]:
    """References to what a snapshot copies: the engine's state and the RNG."""
    rng: dict[str, Any] = {"cpu": torch.get_rng_state()}
    if ctx.device.type == "cuda":
        rng["cuda"] = torch.cuda.get_rng_state(ctx.device)
    return {"engine": ds_compat.engine_state(ctx.engine), "rng": rng}


def load_rank_state(ctx: RankContext, st: TrainState, state: dict[str, Any], m: SnapshotManifest) -> None:
    """Load a snapshot into the running engine and move `st` to it."""
    ds_compat.load_engine_state(ctx.engine, state["engine"])
    torch.set_rng_state(state["rng"]["cpu"])
    if "cuda" in state["rng"] and ctx.device.type == "cuda":
        torch.cuda.set_rng_state(state["rng"]["cuda"], ctx.device)
    st.step, st.skip_windows = m.step, [tuple(w) for w in m.skip_windows]  # type: ignore[misc]
    st.data_position = first_position(m.data_position, st.skip_windows)


def take_snapshot(ctx: RankContext, st: TrainState, step_s: float, *, pin: bool = False) -> None:
    """At a step boundary (every rank): wait for the last snapshot's background work, and take one when
    this step is due (or `pin`: a disk checkpoint's step, kept in the process for a rollback to it)."""
    snaps = ctx.snapshots
    if snaps is None:
        return
    snaps.wait()
    if ctx.spec.checkpoint.memory_every == "auto" and not snaps.tuned and snaps.cost.taken >= AUTO_PROBE:
        _agree_interval(ctx, snaps, step_s)  # every rank took as many: they agree at the same boundary
    if pin or st.step % snaps.every == 0:
        snaps.take(
            st.step,
            rank_state(ctx),
            data_position=st.data_position,
            skip_windows=st.skip_windows,
            pin=pin,
        )


def _agree_interval(ctx: RankContext, snaps: Snapshots, step_s: float) -> None:
    """memory_every auto: the interval each rank measured (a snapshot's copy, waits and background CPU,
    on average over the first ones, against a step), the largest agreed by all ranks."""
    import torch.distributed as dist

    n = torch.tensor([auto_interval(snaps.cost.each_s, step_s)], dtype=torch.int64, device=ctx.device)
    if dist.is_initialized() and ctx.world_size > 1:
        dist.all_reduce(n, op=dist.ReduceOp.MAX)
    snaps.every, snaps.tuned = int(n.item()), True
    if ctx.rank == 0:
        log.info(
            "in-memory snapshots (auto): every %d step(s) (one costs %.1f ms against a %.1f ms step)",
            snaps.every,
            1000 * snaps.cost.each_s,
            1000 * step_s,
        )


def rollback_from_memory(ctx: RankContext, st: TrainState, step: int) -> float | None:
    """Every rank (collective): load the snapshot of `step` held in this process, if every rank holds
    one (no read); its seconds, or None (the caller loads the disk checkpoint)."""
    import torch.distributed as dist

    snaps = ctx.snapshots
    held = snaps.in_process(step) if snaps is not None else None
    have = torch.tensor([1 if held is not None else 0], dtype=torch.int64, device=ctx.device)
    if dist.is_initialized() and ctx.world_size > 1:
        dist.all_reduce(have, op=dist.ReduceOp.MIN)
    if not have.item():
        return None
    assert held is not None
    t0 = time.perf_counter()
    load_rank_state(ctx, st, to_host(held.state), held.manifest)  # a copy: the optimizer keeps what it loads
    return time.perf_counter() - t0


def resume_from_memory(ctx: RankContext, st: TrainState, resume_from: str, skip: bool) -> bool:
    """Every rank (collective), on a relaunch from `resume_from`: load the newest snapshot every rank has
    whole, own copy or its peer's (`Snapshots.resume` says which may be taken). False: none."""
    snaps = ctx.snapshots
    if snaps is None:
        return False
    t0 = time.perf_counter()
    got = snaps.resume(resume_from, ctx.checkpoint_root, skip=skip)
    if got is None:
        return False
    m, data = got
    state = deserialize(data, ds_compat.checkpoint_safe_globals())
    load_rank_state(ctx, st, state, m)
    log.warning(
        "resumed from the in-memory snapshot of step %d in %.3fs (relaunched from %s)",
        st.step,
        time.perf_counter() - t0,
        resume_from,
    )
    return True
