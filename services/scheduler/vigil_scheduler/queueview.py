"""A queue you can read, pure: each waiting job's position, why it waits in words, and when it should start.

`explain` runs the placement pass's own decision (`placement.plan`, with the quotas, the spares, the clock
and the running jobs' expected ends) over a snapshot, and says for each queued job it did not place:

- a quota holds it back: the quota's reason (`quotas.Ledger`);
- it could never fit the healthy cluster;
- it is the blocked head: what it needs, and the reservation (`backfill.reserve`): "needs 8 GPUs on one
  node; reserved for j-... from 14:05 UTC";
- it is behind the head: "behind j-..., which is reserved from 14:05 UTC", and why it cannot backfill
  (it would end after the reservation, or has no time limit, and needs devices the reservation holds);
- its team is over its fair share: "team vision over its share (1.4x)".

The estimated start (`forecast`) replays the queue forward in time: at each running job's expected end its
devices free up and the queue is planned again from that moment; a job's estimate is the first moment it
is placed. None where no end is known (a job without a time limit holds what it needs), a quota holds it, or
it would start only after `MAX_EVENTS` job ends.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from datetime import UTC, datetime

from vigil.spec import format_duration
from vigil_scheduler import fairshare
from vigil_scheduler.backfill import Backfill, Running, freed
from vigil_scheduler.placement import Inventory, PlacementRequest, fits_ever, plan, queue_order, spare_nodes
from vigil_scheduler.quotas import Ledger

# The forecast replays at most this many moments (job ends); jobs placed only later have no estimate. Each
# moment is one `plan` over what is left of the queue: this bounds a reader's cost on a long queue.
MAX_EVENTS = 256


@dataclass(frozen=True, slots=True)
class Entry:
    """One queued job: its position in the queue (1 first), why it waits, when it should start."""

    job_id: str
    position: int
    reason: str
    estimated_start: float | None  # seconds since the epoch; None: unknown
    reserved: bool = False  # it is the blocked head, holding the reservation
    starting: bool = False  # the next placement pass places it (it waits for nothing)


def explain(
    queue: Sequence[PlacementRequest],
    inventory: Inventory,
    now: float,
    running: Sequence[Running] = (),
    *,
    ledger: Ledger | None = None,
    standing: dict[fairshare.Team, fairshare.Standing] | None = None,
    spares: int = 0,
    name: Callable[[str], str] = str,
) -> list[Entry]:
    """Every job of `queue` in queue order with its position, reason and estimated start. `name` says how a
    reason names another job (a viewer who may not see it gets a stand-in)."""
    ordered = sorted(queue, key=queue_order)
    backfill = Backfill(now=now, running=tuple(running))
    placed, _ = plan(ordered, inventory, ledger, spares=spares, backfill=backfill)
    starting = {p.job_id for p in placed}
    held = backfill.reservation
    quota = dict(ledger.waiting) if ledger is not None else {}
    estimates = forecast(
        [r for r in ordered if r.job_id not in quota], inventory, now, running, spares=spares
    )
    public = _public(inventory, spares)
    out = []
    for position, request in enumerate(ordered, start=1):
        reasons = []
        if request.job_id in starting:
            reasons.append("starts in the next placement pass")
        elif request.job_id in quota:
            reasons.append(quota[request.job_id])
        elif not fits_ever(request, public):
            reasons.append(f"needs {_size(request)}: more than the healthy cluster holds")
        elif held is not None and held.job_id == request.job_id:
            reasons.append(
                f"needs {_size(request)}; {_reservation(held.start, backfill.now, name(held.job_id))}"
            )
        elif held is not None:
            reasons.append(_behind(request, held.start, name(held.job_id), backfill.now))
        else:
            reasons.append(f"needs {_size(request)}; waits for devices")
        found = (standing or {}).get(request.team)
        if found is not None and found.over_share and request.job_id not in starting:
            reasons.append(f"team {request.team or '(no team)'} over its share ({found.ratio:.1f}x)")
        out.append(
            Entry(
                job_id=request.job_id,
                position=position,
                reason="; ".join(reasons),
                estimated_start=backfill.now if request.job_id in starting else estimates.get(request.job_id),
                reserved=held is not None and held.job_id == request.job_id,
                starting=request.job_id in starting,
            )
        )
    return out


def forecast(
    queue: Sequence[PlacementRequest],
    inventory: Inventory,
    now: float,
    running: Sequence[Running] = (),
    *,
    spares: int = 0,
) -> dict[str, float]:
    """When each job of `queue` should be placed, replaying the queue at each running job's expected end
    (quotas left out); a job missing from the answer has no estimate."""
    running, remaining = list(running), list(queue)
    starts: dict[str, float] = {}
    for _ in range(min(len(running) + len(remaining) + 1, MAX_EVENTS)):  # each turn places or frees a job
        clock = Backfill(now=now, running=tuple(running))
        placed, inventory = plan(remaining, inventory, spares=spares, backfill=clock)
        starts.update((p.job_id, now) for p in placed)
        remaining = [r for r in remaining if r.job_id not in starts]
        running = list(clock.running)
        ending = [r for r in running if r.ends_at is not None]
        if not remaining or not ending:
            break
        now = max(now, min(r.ends_at for r in ending if r.ends_at is not None))
        done = [r for r in ending if r.ends_at is not None and r.ends_at <= now]
        for job in done:
            inventory = freed(inventory, job.devices)
        running = [r for r in running if r not in done]
    return starts


def at(when: float, now: float) -> str:
    """A moment as a reader wants it: "14:05 UTC" today, "2026-11-29 14:05 UTC" on another day."""
    moment, today = datetime.fromtimestamp(when, UTC), datetime.fromtimestamp(now, UTC)
    return moment.strftime("%H:%M UTC" if moment.date() == today.date() else "%Y-%m-%d %H:%M UTC")


def _size(request: PlacementRequest) -> str:
    gpus = f"{request.world_size} GPU{'s' if request.world_size != 1 else ''}"
    if request.max_nodes == 1:
        return f"{gpus} on one node"
    return f"{gpus} on at most {request.max_nodes} nodes"


def _reservation(start: float | None, now: float, head: str) -> str:
    if start is None:
        return f"reserved for {head} once running jobs without a time limit free enough devices"
    return f"reserved for {head} from {at(start, now)}"


def _behind(request: PlacementRequest, start: float | None, head: str, now: float) -> str:
    if start is None:
        return f"behind {head}, which waits for running jobs without a time limit"
    said = f"behind {head}, which is reserved from {at(start, now)}"
    if request.time_limit is None:
        return f"{said}; it has no time limit and needs devices the reservation holds"
    limit = format_duration(request.time_limit)
    return f"{said}; its time limit ({limit}) ends after that and it needs devices the reservation holds"


def _public(inventory: Inventory, spares: int) -> Inventory:
    """The inventory without the hot spares (what the queue's placements may use)."""
    reserve = spare_nodes(inventory, spares)
    if not reserve:
        return inventory
    return Inventory(tuple(replace(n, alive=False) if n.name in reserve else n for n in inventory.nodes))
