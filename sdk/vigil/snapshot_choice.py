"""Which in-memory snapshot a relaunch takes, and from whom: pure logic over what each rank holds
(`vigil.snapshot` takes, keeps and exchanges them, and re-exports these names). No I/O, no torch.

A rank's peer copy goes to its ring partner, the same local rank on the next node (as GEMINI does); a
relaunch takes the newest step every rank can have whole, its own copy or its peer's (`choose_step`),
or, for a job that changed its size since (elastic), the newest step of its former size whose every
shard some rank's node holds (`choose_resized`)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

AUTO_COST = 0.02  # memory_every "auto": snapshot every step where that costs under 2 % of the step,
AUTO_SPACED_COST = 0.01  # else every N steps, N keeping it under 1 % (the overhead bench's 1.03 holds
# Vigil's other costs too: about 1.6 % of a tiny CPU step)


def ring_partner(rank: int, local_world: int, world: int) -> int | None:
    """The rank that holds `rank`'s peer copy: the same local rank on the next node, or the next rank
    when every rank is on one node; None for a job of one rank."""
    if world < 2:
        return None
    step = local_world if 0 < local_world < world and world % local_world == 0 else 1
    return (rank + step) % world


def ring_source(rank: int, local_world: int, world: int) -> int | None:
    """The rank whose peer copy `rank` holds (the inverse of `ring_partner`)."""
    return next((r for r in range(world) if ring_partner(r, local_world, world) == rank), None)


@dataclass(frozen=True)
class Holdings:
    """The whole snapshots one rank has: of its own shard, and of the shards it holds for peers; and on
    its node, the shards of the job at its other sizes (an elastic job that shrank or grew)."""

    rank: int
    own: tuple[int, ...] = ()
    peer: dict[int, tuple[int, ...]] = field(default_factory=dict)  # source rank -> its steps held here
    elsewhere: dict[tuple[int, int], tuple[int, ...]] = field(default_factory=dict)  # (world, rank) -> steps


def provider(holdings: list[Holdings], rank: int, step: int) -> int | None:
    """Which rank can give `rank` its shard of `step`: itself (own copy first), else a peer holding it."""
    by_rank = {h.rank: h for h in holdings}
    if rank in by_rank and step in by_rank[rank].own:
        return rank
    return next((h.rank for h in holdings if step in h.peer.get(rank, ())), None)


def choose_step(holdings: list[Holdings], world: int, *, lo: int, hi: int | None = None) -> int | None:
    """The newest step in [lo, hi] for which every rank of `world` can have its shard (own or peer)."""
    steps = {s for h in holdings for s in (*h.own, *(s for v in h.peer.values() for s in v))}
    for step in sorted(steps, reverse=True):
        if step < lo or (hi is not None and step > hi):
            continue
        if all(provider(holdings, r, step) is not None for r in range(world)):
            return step
    return None


def resized_provider(holdings: list[Holdings], world: int, rank: int, step: int) -> int | None:
    """Which rank's node holds the shard of `rank` of the job at `world` ranks, of `step`."""
    return next((h.rank for h in holdings if step in h.elsewhere.get((world, rank), ())), None)


def choose_resized(holdings: list[Holdings], *, lo: int, hi: int | None = None) -> tuple[int, int] | None:
    """The newest step in [lo, hi] of the job at another size whose every shard some rank's node holds:
    (that size, the step); None: there is none."""
    best: tuple[int, int] | None = None
    worlds = {w for h in holdings for w, _ in h.elsewhere}
    for world in worlds:
        steps = {s for h in holdings for (w, _), v in h.elsewhere.items() if w == world for s in v}
        for step in sorted(steps, reverse=True):
            if step < lo or (hi is not None and step > hi):
                continue
            if all(resized_provider(holdings, world, r, step) is not None for r in range(world)):
                if best is None or step > best[1]:
                    best = (world, step)
                break
    return best


def auto_interval(cost_s: float, step_s: float) -> int:
    """memory_every "auto": every step when one snapshot costs at most AUTO_COST of a step, else every N
    steps, the smallest N with cost / N <= AUTO_SPACED_COST x step."""
    if step_s <= 0 or cost_s <= AUTO_COST * step_s:
        return 1
    return max(1, math.ceil(cost_s / (AUTO_SPACED_COST * step_s)))
