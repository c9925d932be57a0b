"""EASY backfill, pure: the blocked head job's reservation, and which jobs behind it may start now.

The clock is an argument (`Backfill.now`, seconds since the epoch), never read here. What planning knows
about the running jobs is `Running`: the devices each holds and when it is expected to end (its attempt's
start plus its time limit; None for a job without a limit, which never ends as far as planning knows).

- `reserve`: the head job that does not fit now gets a reservation: the running jobs' devices are freed in
  end-time order until `place` succeeds; the reservation is that time and the devices it would then use.
  When freeing every job with a limit is not enough, there is no reservation time (`Reservation.start`
  None) and the queue behind it waits, as a strict queue does.
- `fits_behind`: a job behind the reserved head starts now when it ends before the reservation (now + its
  time limit <= the reservation's start) or uses none of the reserved devices.

`placement.plan` drives both; `Backfill` carries the clock and the running jobs into it and brings the
reservation back out (`Backfill.reservation`).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field, replace
from itertools import accumulate
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from vigil_scheduler.placement import Inventory, NodeState, Placement, PlacementRequest

Device = tuple[str, int]  # (node, index)


@dataclass(frozen=True, slots=True)
class Running:
    """A running job as planning sees it: its devices, and when it is expected to end."""

    job_id: str
    devices: frozenset[Device]
    ends_at: float | None  # attempt start + time limit; None: no limit, never ends as far as planning knows


@dataclass(frozen=True, slots=True)
class Reservation:
    """The blocked head job's reservation: from `start` (None: unknown, a job without a time limit holds
    what it needs), on `devices` (empty when `start` is None)."""

    request: PlacementRequest
    start: float | None
    devices: frozenset[Device] = frozenset()

    @property
    def job_id(self) -> str:
        return self.request.job_id


@dataclass(slots=True)
class Backfill:
    """One placement pass's clock and running jobs (in), and the blocked head's reservation (out, set by
    `placement.plan`: None when no job was blocked)."""

    now: float = 0.0
    running: tuple[Running, ...] = ()
    reservation: Reservation | None = None
    # Jobs started now behind the reservation (backfilled), by job id: whether each ends before it.
    backfilled: dict[str, bool] = field(default_factory=dict)

    # The inventory a job that would end after the reservation may use (the reserved devices taken), kept
    # with the inventory it was made from while that holds (one per placement, not one per job).
    _outside: tuple[Inventory, Inventory, int] | None = field(
        default=None, init=False, repr=False, compare=False
    )

    def fit_behind(self, request: PlacementRequest, inventory: Inventory) -> tuple[Placement, bool] | None:
        """`fits_behind` for this pass's reservation (None without one)."""
        if self.reservation is None or self.reservation.start is None:
            return None
        if self._outside is None or self._outside[0] is not inventory:
            outside = taken(inventory, self.reservation.devices, self.reservation.job_id)
            self._outside = (inventory, outside, free_count(inventory))
        if self._outside[2] + len(request.reusable) < request.world_size:
            return None  # cannot fit now whatever it avoids
        return fits_behind(request, inventory, self.reservation, self.now, outside=self._outside[1])

    def started(self, placement: Placement, request: PlacementRequest) -> None:
        """A job placed in this pass runs from now on (its devices free up at now + its time limit)."""
        ends = None if request.time_limit is None else self.now + request.time_limit
        self.running = (*self.running, Running(placement.job_id, frozenset(placement.devices), ends))


def reserve(
    request: PlacementRequest, inventory: Inventory, running: Iterable[Running], now: float
) -> Reservation:
    """The earliest time `request` fits, freeing the running jobs' devices in end-time order, and where."""
    from vigil_scheduler.placement import place  # `placement.plan` drives this module: imported at call time

    ending = sorted((r for r in running if r.ends_at is not None), key=lambda r: (r.ends_at, r.job_id))
    # Freeing more never makes `place` fail: search the fewest ending jobs (a prefix) that let it succeed,
    # from the first prefix whose devices could add up to the job's (fewer cannot fit, whatever the nodes).
    free = free_count(inventory) + len(request.reusable)
    first = next(
        (
            i
            for i, n in enumerate(accumulate(len(r.devices) for r in ending))
            if free + n >= request.world_size
        ),
        None,
    )
    if first is None:
        return Reservation(request, None)

    # `place` succeeds exactly when the `max_nodes` nodes offering the job the most devices hold it (it
    # takes the fewest nodes, most free first): count what each node offers as the jobs end, and place once,
    # after the first prefix that holds it, instead of on a freed inventory at every step of a search.
    offered = {n.name: _offered(n, request) for n in inventory.nodes if n.alive}
    healthy = {(n.name, d.index) for n in inventory.nodes if n.alive for d in n.devices if d.healthy}
    gained: dict[str, set[int]] = {}
    for count, job in enumerate(ending, start=1):
        for name, index in job.devices:
            if (name, index) in healthy and index not in offered[name]:
                gained.setdefault(name, set()).add(index)
        if count <= first:
            continue  # too few devices in all yet
        held = sorted((len(free) + len(gained.get(name, ())) for name, free in offered.items()), reverse=True)
        if sum(held[: request.max_nodes]) < request.world_size:
            continue
        best = place(request, freed(inventory, frozenset(d for j in ending[:count] for d in j.devices)))
        assert best is not None, "the devices counted hold it"
        assert job.ends_at is not None
        return Reservation(request, max(now, job.ends_at), frozenset(best.devices))
    return Reservation(request, None)


def _offered(node: NodeState, request: PlacementRequest) -> frozenset[int]:
    """The devices of a live `node` that `place` counts free for `request`."""
    from vigil_scheduler.placement import usable

    if any(name == node.name for name, _ in request.reusable):
        return frozenset(d.index for d in node.devices if usable(node, d, request))
    return frozenset(node.free)


def fits_behind(
    request: PlacementRequest,
    inventory: Inventory,
    reservation: Reservation,
    now: float,
    *,
    outside: Inventory | None = None,
) -> tuple[Placement, bool] | None:
    """Where a job behind the reserved head may start now, and whether it ends before the reservation;
    None when it may not (or does not fit). `outside`: `inventory` with the reserved devices taken, when
    the caller has it already."""
    from vigil_scheduler.placement import place

    if reservation.start is None:
        return None
    limit = request.time_limit
    if limit is not None and now + limit <= reservation.start:
        placement = place(request, inventory)
        return None if placement is None else (placement, True)
    if outside is None:
        outside = taken(inventory, reservation.devices, reservation.job_id)
    placement = place(request, outside)
    return None if placement is None else (placement, False)


def free_count(inventory: Inventory) -> int:
    """The devices free now on live nodes (an upper bound of what `place` may use)."""
    return sum(len(n.free) for n in inventory.nodes if n.alive)


def freed(inventory: Inventory, devices: frozenset[Device]) -> Inventory:
    """The inventory with `devices` given to no job and reported free (as once their job has ended)."""
    from vigil_scheduler.placement import Inventory, NodeState, Slot

    nodes: dict[str, set[int]] = {}
    for name, index in devices:
        nodes.setdefault(name, set()).add(index)

    def free(n: NodeState) -> NodeState:
        wanted = nodes.get(n.name)
        if wanted is None:
            return n
        slots = tuple(
            Slot(d.index, d.kind, d.healthy, True, None, d.nvlink)  # `replace` costs 5x more, and this is hot
            if d.index in wanted and (d.job_id is not None or not d.reported_free)
            else d
            for d in n.devices
        )
        return NodeState(n.name, slots, n.alive, n.address)

    return Inventory(tuple(free(n) for n in inventory.nodes))


def taken(inventory: Inventory, devices: frozenset[Device], job_id: str) -> Inventory:
    """The inventory with `devices` given to `job_id` (out of any other job's placement)."""
    from vigil_scheduler.placement import Inventory

    nodes = {name for name, _ in devices}

    def hold(n: NodeState) -> NodeState:
        if n.name not in nodes:
            return n
        return replace(
            n,
            devices=tuple(
                replace(d, job_id=job_id) if (n.name, d.index) in devices else d for d in n.devices
            ),
        )

    return Inventory(tuple(hold(n) for n in inventory.nodes))
