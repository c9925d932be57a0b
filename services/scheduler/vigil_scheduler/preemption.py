"""Preemption's victims: which running jobs a job that cannot be placed stops. Pure: no I/O, no clock.

`choose(request, inventory, running)` returns the victims whose devices, once free, let `placement.place`
place `request`; None when no such set exists. The rules:

1. A victim has a lower priority than the job that needs its devices, and is preemptible (its spec's
   `scheduling.preemptible`, or the operator's `VIGIL_PREEMPTIBLE_BELOW_PRIORITY` where the spec leaves it
   unset: `preemptible`). Never a job of equal or higher priority, never one that is not preemptible.
2. Of the sets that let the job be placed, the one that takes the fewest GPUs from teams within their
   share (a team over its fair share borrowed what it holds: its jobs are taken first, as Kueue takes back
   borrowed quota), then the fewest GPUs in all, then the youngest (the set whose oldest victim started
   last), then the fewest jobs.
3. Exact over every set while there are few candidates (`EXACT_UP_TO`); beyond, greedy in that order
   of preference, then every victim the placement does not need is spared again. When every candidate
   together does not make room, no set is tried (the pass asks each time a job stays blocked).

The victims' devices count as free here as soon as they are chosen: the placement pass that runs once
they exit finds them so (their worker reports them free, their job is requeued).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, replace
from itertools import combinations

from vigil_scheduler.placement import Inventory, Placement, PlacementRequest, place

EXACT_UP_TO = 10  # candidates for which every set is tried (1,023 sets at most)


@dataclass(frozen=True, slots=True)
class Running:
    """A running job as preemption sees it."""

    job_id: str
    priority: int
    preemptible: bool
    started: float  # when its attempt started running (any monotonic scale): larger is younger
    team: str | None = None


@dataclass(frozen=True, slots=True)
class Victims:
    jobs: tuple[Running, ...]
    placement: Placement  # where the job that preempts them goes once they are gone
    gpus: int  # the devices they free


def preemptible(spec_says: bool | None, priority: int, below_priority: int) -> bool:
    """A job's spec `scheduling.preemptible`, or where unset the operator's rule: priority below
    `below_priority` (`VIGIL_PREEMPTIBLE_BELOW_PRIORITY`)."""
    return spec_says if spec_says is not None else priority < below_priority


def freed(inventory: Inventory, job_ids: Iterable[str]) -> Inventory:
    """The inventory with every device of `job_ids` unassigned and reported free (as once they exit)."""
    gone = set(job_ids)
    if not gone:
        return inventory
    nodes = tuple(
        replace(
            n,
            devices=tuple(
                replace(d, job_id=None, reported_free=True) if d.job_id in gone else d for d in n.devices
            ),
        )
        if any(d.job_id in gone for d in n.devices)
        else n
        for n in inventory.nodes
    )
    return Inventory(nodes)


def choose(
    request: PlacementRequest,
    inventory: Inventory,
    running: Sequence[Running],
    over_share: Callable[[str | None], bool] = lambda team: False,
) -> Victims | None:
    """The victims that let `request` be placed (see the module docstring), or None.

    `over_share(team)`: whether a team holds more than its fair share now (its jobs are taken first); by
    default no team is."""
    held: dict[str, int] = {}
    for node in inventory.nodes:
        for d in node.devices:
            if d.job_id is not None:
                held[d.job_id] = held.get(d.job_id, 0) + 1
    candidates = [
        r for r in running if r.preemptible and r.priority < request.priority and held.get(r.job_id)
    ]
    if not candidates:
        return None

    def key(group: Sequence[Running]) -> tuple[int, int, float, int]:
        own = sum(held[r.job_id] for r in group if not over_share(r.team))
        return own, sum(held[r.job_id] for r in group), -min(r.started for r in group), len(group)

    def fits(group: Sequence[Running]) -> Placement | None:
        return place(request, freed(inventory, (r.job_id for r in group)))

    if fits(candidates) is None:
        return None  # not even every candidate's devices together make room
    free = sum(len(n.free) for n in inventory.nodes if n.alive)
    best: tuple[tuple[int, int, float, int], tuple[Running, ...], Placement] | None = None
    if len(candidates) <= EXACT_UP_TO:
        for size in range(1, len(candidates) + 1):
            for group in combinations(candidates, size):
                k = key(group)
                if (best is not None and k >= best[0]) or free + k[1] < request.world_size:
                    continue  # no better than the best, or too few devices in all to place it
                if (placement := fits(group)) is not None:
                    best = (k, group, placement)
    else:
        best = _greedy(candidates, key, fits)
    if best is None:
        return None
    _, group, placement = best
    return Victims(tuple(group), placement, sum(held[r.job_id] for r in group))


def _greedy(
    candidates: list[Running],
    key: Callable[[Sequence[Running]], tuple[int, int, float, int]],
    fits: Callable[[Sequence[Running]], Placement | None],
) -> tuple[tuple[int, int, float, int], tuple[Running, ...], Placement] | None:
    """Take candidates in order of preference until the job fits, then spare again each victim (the
    largest first) without which it still fits."""
    order = sorted(candidates, key=lambda r: key([r]))
    group: list[Running] = []
    placement = None
    for r in order:
        group.append(r)
        if (placement := fits(group)) is not None:
            break
    if placement is None:
        return None
    for r in sorted(group, key=lambda r: key([r]), reverse=True):
        rest = [g for g in group if g is not r]
        if rest and (smaller := fits(rest)) is not None:
            group, placement = rest, smaller
    return key(group), tuple(group), placement
