"""Gang placement: which devices a job's ranks run on. Pure: no I/O, no clock, no randomness.

`place(request, inventory)` returns a `Placement` for every rank of the job, or None when the job
does not fit right now (all ranks or none). The rules, in order:

1. Only devices that are healthy, on a live node, assigned to no job, and reported free by their
   worker (a device the job's own previous attempt held counts as free: the worker ends those old
   ranks when it sees the new launch).
2. Fewest nodes, at most `request.max_nodes` of them.
3. Packed: the largest free blocks are filled first and the last node is the best fit (the node with
   the fewest free devices that still holds the remainder), so big free nodes stay whole for big jobs.
4. On GPU nodes, devices joined by NVLink are preferred when only part of a node's free devices is used.

`plan(queue, inventory, ledger, backfill=...)` walks a queue in priority, then fair-share (`fairshare`),
then submission order, and places what fits; with a `quotas.Ledger`, a job its owner's or team's GPU quota
holds back waits (with the reason in `ledger.waiting`) without holding up the jobs behind it. The first job
that does not fit gets a reservation, and the jobs behind it that do not delay it start now (EASY
backfill, `backfill`; the clock and the running jobs come in a `backfill.Backfill`).

Hot spares (`spare_nodes`, `VIGIL_HOT_SPARES`): whole free nodes held in reserve. The queue's placements
never use them; a job whose previous attempt lost a node or a device (`lost_capacity`) takes one when the
free capacity does not hold it, ahead of the queue (a blocked head job does not hold it up). The reserve
refills from freed capacity first: it is chosen before the queue is placed.

Elastic shrink (`PlacementRequest.shrink_nodes`, from the spec's `resources.elastic`): a job that lost
capacity, and fits neither on free capacity nor on a spare, continues on fewer nodes: the largest count
it allows, on the nodes it held where they hold it (its parked survivors take the launch there), with
`world_size x n / max_nodes` ranks. Like a spare, a shrink is not held up by a blocked head job (it then
uses only the nodes it held and the spares). A job running shrunk that is requeued again tries its whole
size first, and continues shrunk when that does not fit.

Elastic grow (`grow`): a job running shrunk grows back to its whole size when that placement, as one of
its own in queue order, fits now on the devices it holds plus the free capacity (never a spare): a job
ahead of it in the queue that fits takes the room first, and a blocked head holds it up as any job.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field, replace
from itertools import accumulate, pairwise

from vigil_scheduler.backfill import Backfill, reserve
from vigil_scheduler.quotas import Ledger

# How many equally good best-fit nodes are compared by NVLink quality (bounds the cost on big clusters).
_NVLINK_CANDIDATES = 16


@dataclass(frozen=True, slots=True)
class Slot:
    """One device of a node as the scheduler sees it."""

    index: int
    kind: str = "gpu"
    healthy: bool = True
    reported_free: bool = True
    job_id: str | None = None
    nvlink: frozenset[int] = frozenset()


@dataclass(frozen=True, slots=True)
class NodeState:
    name: str
    devices: tuple[Slot, ...]
    alive: bool = True
    address: str = "127.0.0.1"
    # Indexed once per snapshot (placement reads it for every node of the cluster): the devices that
    # are healthy, given to no job and reported free by the worker.
    free: tuple[int, ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        free = tuple(d.index for d in self.devices if d.healthy and d.job_id is None and d.reported_free)
        object.__setattr__(self, "free", free)


@dataclass(frozen=True, slots=True)
class Inventory:
    nodes: tuple[NodeState, ...]

    def node(self, name: str) -> NodeState | None:
        return next((n for n in self.nodes if n.name == name), None)

    def assigned(self, job_id: str) -> set[tuple[str, int]]:
        """The devices assigned to `job_id`."""
        return {(n.name, d.index) for n in self.nodes for d in n.devices if d.job_id == job_id}

    def assign(self, placement: Placement) -> Inventory:
        """A new inventory with the placement's devices given to its job; ValueError on a taken device."""
        wanted: dict[str, set[int]] = {}
        for r in placement.ranks:
            wanted.setdefault(r.node, set()).add(r.device)
        nodes = []
        for n in self.nodes:
            picks = wanted.pop(n.name, None)
            if not picks:
                nodes.append(n)
                continue
            devices = []
            for d in n.devices:
                if d.index in picks:
                    if d.job_id not in (None, placement.job_id):
                        raise ValueError(f"device {n.name}:{d.index} already belongs to job {d.job_id}")
                    d = replace(d, job_id=placement.job_id)
                    picks.discard(d.index)
                devices.append(d)
            if picks:
                raise ValueError(f"node {n.name} has no device(s) {sorted(picks)}")
            nodes.append(replace(n, devices=tuple(devices)))
        if wanted:
            raise ValueError(f"unknown node(s) {sorted(wanted)}")
        return Inventory(tuple(nodes))

    def release(self, job_id: str) -> Inventory:
        """A new inventory with every device of `job_id` unassigned."""

        def free(n: NodeState) -> NodeState:
            if not any(d.job_id == job_id for d in n.devices):
                return n
            return replace(
                n, devices=tuple(replace(d, job_id=None) if d.job_id == job_id else d for d in n.devices)
            )

        return Inventory(tuple(free(n) for n in self.nodes))


@dataclass(frozen=True, slots=True)
class PlacementRequest:
    """What a job asks for: `world_size` ranks on at most `max_nodes` nodes."""

    job_id: str
    world_size: int
    max_nodes: int
    priority: int = 0
    seq: int = 0  # submission order
    reusable: frozenset[tuple[str, int]] = field(default_factory=frozenset)
    owner: str | None = None  # whose quota the job counts against (`quotas`)
    team: str | None = None
    # Elastic: the node counts below `max_nodes` it may continue on, largest first (each at
    # `world_size / max_nodes` ranks a node); empty: it is not elastic (see `vigil.spec.shrink_node_counts`).
    shrink_nodes: tuple[int, ...] = ()
    # How long an attempt may run (seconds; None: no limit): when its devices free up (`backfill`).
    time_limit: float | None = None
    # Its team's fair-share factor (`fairshare.factors`), 1 (no usage) down to 0: orders equal priorities.
    share_factor: float = 1.0

    def __post_init__(self) -> None:
        if self.world_size < 1:
            raise ValueError(f"world_size must be at least 1, got {self.world_size}")
        if self.max_nodes < 1:
            raise ValueError(f"max_nodes must be at least 1, got {self.max_nodes}")
        if self.shrink_nodes:
            if self.world_size % self.max_nodes:
                raise ValueError(
                    f"an elastic job's world_size ({self.world_size}) must be a multiple of its max_nodes "
                    f"({self.max_nodes})"
                )
            counts = self.shrink_nodes
            if any(not 1 <= n < self.max_nodes for n in counts) or any(a <= b for a, b in pairwise(counts)):
                raise ValueError(
                    f"shrink_nodes {self.shrink_nodes} must be distinct counts from {self.max_nodes - 1} "
                    "down to 1, largest first"
                )

    def on_nodes(self, nodes: int) -> PlacementRequest:
        """The same job asked for on `nodes` nodes (a shrink): `world_size x nodes / max_nodes` ranks."""
        per_node = self.world_size // self.max_nodes
        return replace(self, world_size=per_node * nodes, max_nodes=nodes, shrink_nodes=())


@dataclass(frozen=True, slots=True)
class RankSlot:
    rank: int
    node: str
    device: int
    local_rank: int


@dataclass(frozen=True, slots=True)
class Placement:
    job_id: str
    ranks: tuple[RankSlot, ...]

    @property
    def nodes(self) -> list[str]:
        """The nodes used, in rank order (rank 0's node first)."""
        return list(dict.fromkeys(r.node for r in self.ranks))

    @property
    def devices(self) -> set[tuple[str, int]]:
        return {(r.node, r.device) for r in self.ranks}


def usable(node: NodeState, slot: Slot, request: PlacementRequest) -> bool:
    if not (node.alive and slot.healthy):
        return False
    if slot.job_id is not None and slot.job_id != request.job_id:
        return False
    return slot.reported_free or slot.job_id == request.job_id or (node.name, slot.index) in request.reusable


def capacity(node: NodeState) -> int:
    """Devices the node could ever offer: healthy ones on a live node."""
    return sum(1 for d in node.devices if d.healthy) if node.alive else 0


def fits_ever(request: PlacementRequest, inventory: Inventory) -> bool:
    """Whether the job would fit if every healthy device were free (otherwise waiting cannot help)."""
    sizes = sorted((capacity(n) for n in inventory.nodes), reverse=True)[: request.max_nodes]
    return sum(sizes) >= request.world_size


def place(request: PlacementRequest, inventory: Inventory) -> Placement | None:
    """Place every rank of the job, or none. See the module docstring for the rules."""
    by_count: dict[int, list[tuple[NodeState, Sequence[int]]]] = {}
    own_nodes = {name for name, _ in request.reusable}
    for node in inventory.nodes:
        if not node.alive:
            continue
        free: Sequence[int] = node.free
        if node.name in own_nodes:  # the job's previous devices count as free although still busy
            free = [d.index for d in node.devices if usable(node, d, request)]
        if free:
            by_count.setdefault(len(free), []).append((node, free))
    # Most free devices first; ties in inventory order (by name, as the scheduler loads it).
    candidates = [c for count in sorted(by_count, reverse=True) for c in by_count[count]]
    need = request.world_size
    prefix = list(accumulate(len(free) for _, free in candidates[: request.max_nodes]))
    k = next((i + 1 for i, total in enumerate(prefix) if total >= need), None)
    if k is None:
        return None

    # The k-1 largest nodes are used whole; the remainder goes to the best-fit node among the rest.
    chosen: list[tuple[NodeState, Sequence[int]]] = []
    remaining = need
    for node, free in candidates[: k - 1]:
        chosen.append((node, free))
        remaining -= len(free)
    rest = candidates[k - 1 :]
    smallest_fit = min(len(free) for _, free in rest if len(free) >= remaining)
    tied = [c for c in rest if len(c[1]) == smallest_fit][:_NVLINK_CANDIDATES]
    best = max(tied, key=lambda c: _nvlink_edges(c[0], _pick(c[0], c[1], remaining)))
    chosen.append((best[0], _pick(best[0], best[1], remaining)))

    ranks: list[RankSlot] = []
    for node, indices in chosen:
        take = indices if len(indices) <= need - len(ranks) else _pick(node, indices, need - len(ranks))
        for local, index in enumerate(sorted(take)):
            ranks.append(RankSlot(rank=len(ranks), node=node.name, device=index, local_rank=local))
    return Placement(job_id=request.job_id, ranks=tuple(ranks))


def spare_nodes(inventory: Inventory, count: int) -> frozenset[str]:
    """The nodes held in reserve: up to `count` whole free nodes (alive, every device healthy, reported
    free and given to no job), the last in the inventory's (name) order, so a spare stays one while it
    stays free. With fewer whole free nodes the reserve is short until capacity frees."""
    if count <= 0:
        return frozenset()
    whole = [n.name for n in inventory.nodes if n.alive and n.devices and len(n.free) == len(n.devices)]
    return frozenset(whole[-count:])


def lost_capacity(request: PlacementRequest, inventory: Inventory) -> bool:
    """Did the job's previous attempt lose a node or a device? One of the devices it held is on a node no
    longer alive (or gone from the inventory), or is unhealthy now (marked by strikes or its worker)."""
    for name, index in request.reusable:
        node = inventory.node(name)
        slot = None if node is None else next((d for d in node.devices if d.index == index), None)
        if node is None or not node.alive or slot is None or not slot.healthy:
            return True
    return False


def may_shrink(request: PlacementRequest, inventory: Inventory) -> bool:
    """May the job continue on fewer nodes? It is elastic, and its previous attempt lost capacity
    (`lost_capacity`) or already ran shrunk (held fewer devices than the job asks for)."""
    if not request.shrink_nodes or not request.reusable:
        return False
    return lost_capacity(request, inventory) or len(request.reusable) < request.world_size


def shrink(request: PlacementRequest, room: Inventory) -> Placement | None:
    """The job on the largest node count of `request.shrink_nodes` that `room` holds; at each count, on
    the nodes its previous attempt held first (its parked survivors take the launch), then anywhere in
    `room`. None when no count fits."""
    own = {name for name, _ in request.reusable}
    survivors = _masked(room, own.__contains__)
    for nodes in request.shrink_nodes:
        smaller = request.on_nodes(nodes)
        placement = place(smaller, survivors) or place(smaller, room)
        if placement is not None:
            return placement
    return None


def grow(
    request: PlacementRequest,
    queue: Iterable[PlacementRequest],
    inventory: Inventory,
    ledger: Ledger | None = None,
    *,
    spares: int = 0,
) -> Placement | None:
    """The whole-size placement of a job running shrunk, if the queue would give it one now.

    `request` is the job at its whole size, `reusable` the devices it holds now (running); `queue` the jobs
    waiting for a placement. The job is placed among them in queue order (`plan`), as if it were queued: on
    its own devices and the free capacity, never on a spare, and never shrunk. None:
    a job ahead of it takes the room, a blocked job ahead of it holds it up, its quota does not allow it,
    or the room is not there.
    """
    whole = replace(request, shrink_nodes=())
    if lost_capacity(whole, inventory):
        return None  # a device it runs on is failing: that is a recovery's to handle, not a growth's
    others = [r for r in queue if r.job_id != request.job_id]
    placed, _ = plan([*others, whole], inventory, ledger, spares=spares)
    mine = next((p for p in placed if p.job_id == request.job_id), None)
    return mine if mine is not None and len(mine.ranks) == request.world_size else None


def _masked(inventory: Inventory, keep: Callable[[str], bool]) -> Inventory:
    """The inventory with every node `keep` refuses taken out of placement (as if not alive)."""
    return Inventory(tuple(n if keep(n.name) else replace(n, alive=False) for n in inventory.nodes))


def queue_order(request: PlacementRequest) -> tuple[int, float, int]:
    """The queue's order: priority high to low, then fair-share factor high to low, then submission."""
    return (-request.priority, -request.share_factor, request.seq)


def plan(
    queue: Iterable[PlacementRequest],
    inventory: Inventory,
    ledger: Ledger | None = None,
    *,
    spares: int = 0,
    backfill: Backfill | None = None,
) -> tuple[list[Placement], Inventory]:
    """Place jobs in queue order (`queue_order`: priority, then fair share, then submission order).

    A job that does not fit now but would fit once devices free up is blocked: it gets a reservation
    (`backfill.reserve`, into `backfill.reservation`): the earliest time the running jobs' time limits free
    enough devices, and the devices it would then use. A job behind it starts now only when it ends before
    that time or uses none of those devices (`backfill.fits_behind`); without a reservation time (a job
    with no time limit holds what it needs) the jobs behind it wait, so a big job is not starved by a stream
    of small ones. A job that could never fit (more ranks than the healthy cluster holds) blocks nobody, and
    neither does a job its quota holds back (`ledger`: it waits for its own owner's or team's jobs, not for
    devices, so others' jobs go ahead).

    `spares` whole free nodes are held in reserve (`spare_nodes`): no placement uses them but that of a
    job that lost capacity (`lost_capacity`), and only where the free capacity does not hold it; behind a
    blocked job, such a job still takes a spare (with the nodes it held).

    An elastic job that lost capacity and fits neither way is placed on fewer nodes (`shrink`), from the
    free capacity and the spares; behind a blocked job, from the nodes it held and the spares only.

    `backfill` None: a clock at 0 and no running job known, so a blocked job holds up the queue behind it.
    """
    backfill = backfill if backfill is not None else Backfill()
    backfill.reservation, backfill.backfilled = None, {}
    reserve_nodes = spare_nodes(inventory, spares)
    placed: list[Placement] = []
    public, public_of = inventory, None  # the inventory without the spares (`public_of`: made from)
    for request in sorted(queue, key=queue_order):
        held = backfill.reservation
        if held is not None and held.start is None and not (reserve_nodes or request.shrink_nodes):
            continue  # behind a blocked job with no reservation time only a spare or a shrink is placed
        quota = (request.job_id, request.owner, request.team, request.world_size)
        if ledger is not None and (why := ledger.refusal(*quota)) is not None:
            ledger.waiting[request.job_id] = why
            continue
        if not reserve_nodes:
            public = inventory
        elif public_of is not inventory:  # made again only once a placement changed the inventory
            public, public_of = _masked(inventory, lambda name: name not in reserve_nodes), inventory
        may_spare = bool(reserve_nodes) and lost_capacity(request, inventory)
        room = inventory if may_spare else public  # where it may go not held up by a blocked job
        if held is not None and (may_spare or request.shrink_nodes):
            # behind a blocked job: the spares and its own nodes, never the free capacity
            own = {name for name, _ in request.reusable} | (reserve_nodes if may_spare else set())
            room = _masked(inventory, own.__contains__)
        placement = None
        if held is None:
            placement = place(request, public)
            if placement is None and may_spare:
                placement = place(request, room)  # the free capacity and the spares
        else:
            if may_spare:
                placement = place(request, room)
            if placement is None and (fit := backfill.fit_behind(request, public)) is not None:
                placement, backfill.backfilled[request.job_id] = fit
        if placement is None and may_shrink(request, inventory):
            placement = shrink(request, room)
        if placement is not None:
            inventory = inventory.assign(placement)
            placed.append(placement)
            backfill.started(placement, request)
            if ledger is not None:
                ledger.take(request.job_id, request.owner, request.team, len(placement.ranks))
        elif held is None and fits_ever(request, public):
            backfill.reservation = reserve(request, public, backfill.running, backfill.now)
    return placed, inventory


def _pick(node: NodeState, free: Sequence[int], count: int) -> list[int]:
    """`count` of the node's free devices: on GPU nodes the set with the most NVLink edges among them."""
    if count >= len(free):
        return list(free)
    by_index = {d.index: d for d in node.devices}
    if not any(by_index[i].nvlink for i in free) or by_index[free[0]].kind != "gpu":
        return sorted(free)[:count]
    free_set = set(free)
    best: list[int] = []
    best_edges = -1
    for start in sorted(free):  # greedy growth from every start; nodes hold a handful of GPUs
        group = [start]
        while len(group) < count:
            links = {i: len(by_index[i].nvlink & set(group)) for i in free_set.difference(group)}
            group.append(max(sorted(links), key=lambda i: links[i]))
        edges = _edges(by_index, group)
        if edges > best_edges:
            best, best_edges = group, edges
    return sorted(best)


def _edges(by_index: dict[int, Slot], group: Sequence[int]) -> int:
    members = set(group)
    return sum(len(by_index[i].nvlink & members) for i in group) // 2


def _nvlink_edges(node: NodeState, group: Sequence[int]) -> int:
    return _edges({d.index: d for d in node.devices}, group)
