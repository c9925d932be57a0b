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
    for job in ending:
        inventory = freed(inventory, job.devices)
        placement = place(request, inventory)
        if placement is not None:
            assert job.ends_at is not None
            return Reservation(request, max(now, job.ends_at), frozenset(placement.devices))
    return Reservation(request, None)


def fits_behind(
    request: PlacementRequest, inventory: Inventory, reservation: Reservation, now: float
) -> tuple[Placement, bool] | None:
    """Where a job behind the reserved head may start now, and whether it ends before the reservation;
    None when it may not (or does not fit)."""
    from vigil_scheduler.placement import place

    if reservation.start is None:
        return None
    limit = request.time_limit
    if limit is not None and now + limit <= reservation.start:
        placement = place(request, inventory)
        return None if placement is None else (placement, True)
    placement = place(request, taken(inventory, reservation.devices, reservation.job_id))
    return None if placement is None else (placement, False)


def freed(inventory: Inventory, devices: frozenset[Device]) -> Inventory:
    """The inventory with `devices` given to no job and reported free (as once their job has ended)."""
    from vigil_scheduler.placement import Inventory

    nodes = {name for name, _ in devices}

    def free(n: NodeState) -> NodeState:
        if n.name not in nodes:
            return n
        return replace(
            n,
            devices=tuple(
                replace(d, job_id=None, reported_free=True) if (n.name, d.index) in devices else d
                for d in n.devices
            ),
        )

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
