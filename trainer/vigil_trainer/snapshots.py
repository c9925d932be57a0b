"""What an in-memory snapshot of the built-in trainer holds, and loading one (the SDK takes them, keeps
them and exchanges them: `Run.snapshot`, `Run.restore`, as for any program).

A rank's snapshot holds what its part of the disk checkpoint holds (`ds_compat.engine_state`: the
module, its ZeRO optimizer partition, the LR scheduler, the step counters) and the RNG; its manifest the
step, data position and skip windows. Not under ZeRO-3 (its module is partitioned: not done yet). A job
that changed its size (elastic) loads every former rank's snapshot, re-partitioned (`load_resized_state`).
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from vigil.integrations import ds_compat
from vigil_trainer.context import RankContext

log = logging.getLogger("vigil.rank")


def rank_state(ctx: RankContext) -> dict[str, Any]:
    """References to what a snapshot copies: the engine's state and the RNG."""
    rng: dict[str, Any] = {"cpu": torch.get_rng_state()}
    if ctx.device.type == "cuda":
        rng["cuda"] = torch.cuda.get_rng_state(ctx.device)
    return {"engine": ds_compat.engine_state(ctx.engine), "rng": rng}


def load_rank_state(ctx: RankContext, state: dict[str, Any]) -> None:
    """Load a snapshot's state into the running engine, and its RNG."""
    ds_compat.load_engine_state(ctx.engine, state["engine"])
    _load_rng(ctx, state)


def load_resized_state(ctx: RankContext, states: list[dict[str, Any]]) -> None:
    """Load every former rank's snapshot (an elastic job that shrank or grew): the engine's state
    re-partitioned to this size (`ds_compat.load_resized_engine_state`), the RNG of the former rank of
    the same number (or of `rank % former size`)."""
    rank = ctx.run.identity.rank
    ds_compat.load_resized_engine_state(ctx.engine, [s["engine"] for s in states], rank)
    _load_rng(ctx, states[rank % len(states)])


def _load_rng(ctx: RankContext, state: dict[str, Any]) -> None:
    torch.set_rng_state(state["rng"]["cpu"])
    if "cuda" in state["rng"] and ctx.device.type == "cuda":
        torch.cuda.set_rng_state(state["rng"]["cuda"], ctx.device)


def register(ctx: RankContext) -> None:
    """Every rank: the run's in-memory snapshots of this trainer, as the spec's `checkpoint.memory_every`
    says (0: none; off under ZeRO-3)."""
    every = ctx.spec.checkpoint.memory_every
    if every == 0:
        return
    if ctx.zero_stage == 3:
        if ctx.run.identity.rank == 0:
            log.warning("in-memory snapshots: off under ZeRO-3 (disk checkpoints only)")
        return
    ctx.run.snapshot(lambda: rank_state(ctx), load=lambda state: load_rank_state(ctx, state), every=every)
