"""Property tests: placement never over-allocates, is all-or-none, never uses unhealthy devices, and a
job's devices are released on every terminal state."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from vigil.jobstates import JobState
from vigil_scheduler import states
from vigil_scheduler.placement import Inventory, NodeState, Placement, PlacementRequest, Slot, place, plan

MOSTLY = st.sampled_from([True, True, True, False])  # enough free devices that many requests fit


@st.composite
def inventories(draw: st.DrawFn) -> Inventory:
    nodes = []
    for i in range(draw(st.integers(1, 6))):
        size = draw(st.integers(1, 8))
        devices = []
        for d in range(size):
            peers = draw(st.sets(st.integers(0, size - 1), max_size=3)) - {d}
            devices.append(
                Slot(
                    index=d,
                    kind=draw(st.sampled_from(["gpu", "cpu"])),
                    healthy=draw(MOSTLY),
                    reported_free=draw(MOSTLY),
                    job_id=draw(st.sampled_from([None, None, None, None, "busy-1", "busy-2"])),
                    nvlink=frozenset(peers),
                )
            )
        nodes.append(NodeState(name=f"n{i}", devices=tuple(devices), alive=draw(MOSTLY)))
    return Inventory(tuple(nodes))


requests = st.builds(
    PlacementRequest,
    job_id=st.just("j"),
    world_size=st.integers(1, 20),
    max_nodes=st.integers(1, 6),
)


def free_counts(inv: Inventory) -> list[int]:
    """Each node's free devices (alive, healthy, given to no job, reported free), most first."""
    return sorted(
        (
            sum(1 for d in n.devices if n.alive and d.healthy and d.job_id is None and d.reported_free)
            for n in inv.nodes
        ),
        reverse=True,
    )


def fits_now(inv: Inventory, request: PlacementRequest) -> bool:
    return sum(free_counts(inv)[: request.max_nodes]) >= request.world_size


def test_place_respects_every_rule_and_places_what_fits() -> None:
    """Every placement keeps every rule, a request that fits the free devices is placed (a `place` that
    always refused would pass the rules alone), and enough examples were placed to say so."""
    placed: list[int] = []

    @given(inventories(), requests)
    @settings(max_examples=300, deadline=None, derandomize=True)  # the same examples each run: a fixed count
    def check(inv: Inventory, request: PlacementRequest) -> None:
        p = place(request, inv)
        assert (p is not None) == fits_now(inv, request), (inv, request)
        if p is not None:
            respects_every_rule(inv, request, p)
            placed.append(request.world_size)

    check()
    assert len(placed) >= 50, f"only {len(placed)} of 300 examples placed: the property says little"
    print(f"\nplacement rules: {len(placed)} of 300 placed")


def respects_every_rule(inv: Inventory, request: PlacementRequest, p: Placement) -> None:
    assert len(p.ranks) == request.world_size  # all ranks, never a partial gang
    assert len(p.devices) == request.world_size  # never a device twice
    assert [r.rank for r in p.ranks] == list(range(request.world_size))
    assert len(p.nodes) <= request.max_nodes
    for r in p.ranks:
        n = inv.node(r.node)
        assert n is not None and n.alive
        slot = next(d for d in n.devices if d.index == r.device)
        assert slot.healthy and slot.job_id is None and slot.reported_free
    for name in p.nodes:
        locals_ = [r.local_rank for r in p.ranks if r.node == name]
        assert locals_ == list(range(len(locals_)))
    inv.assign(p)  # raises if any device were taken


def test_fewest_nodes() -> None:
    placed: list[int] = []

    @given(inventories(), requests)
    @settings(max_examples=200, deadline=None, derandomize=True)  # the same examples each run: a fixed count
    def check(inv: Inventory, request: PlacementRequest) -> None:
        p = place(request, inv)
        if p is None:
            return
        free = free_counts(inv)
        fewest = next(k for k in range(1, len(free) + 1) if sum(free[:k]) >= request.world_size)
        assert len(p.nodes) == fewest
        placed.append(len(p.nodes))

    check()
    assert len(placed) >= 30 and max(placed) >= 2, placed  # multi-node placements among them
    print(f"\nfewest nodes: {len(placed)} placed, {sum(n >= 2 for n in placed)} on several nodes")


@given(inventories(), st.lists(requests, min_size=1, max_size=6))
@settings(max_examples=200, deadline=None)
def test_plan_never_over_allocates(inv: Inventory, reqs: list[PlacementRequest]) -> None:
    queue = [PlacementRequest(f"j{i}", r.world_size, r.max_nodes, seq=i) for i, r in enumerate(reqs)]
    placed, after = plan(queue, inv)
    seen: set[tuple[str, int]] = set()
    for p in placed:
        assert seen.isdisjoint(p.devices)
        seen |= p.devices
        assert after.assigned(p.job_id) == p.devices


# A small model of the scheduler's book-keeping: random submissions, placement passes and
# transitions; devices are held exactly while the job is in a state that holds devices.
ops = st.lists(
    st.one_of(
        st.tuples(st.just("submit"), st.integers(1, 6)),
        st.tuples(st.just("place"), st.just(0)),
        st.tuples(st.just("move"), st.integers(0, 50), st.sampled_from(list(JobState))),
    ),
    max_size=40,
)


@given(inventories(), ops)
@settings(max_examples=200, deadline=None)
def test_devices_released_on_every_terminal_state(inv: Inventory, steps: list[tuple]) -> None:
    jobs: dict[str, JobState] = {}
    wants: dict[str, PlacementRequest] = {}
    for step in steps:
        if step[0] == "submit":
            job = f"j{len(jobs)}"
            jobs[job] = JobState.PENDING
            wants[job] = PlacementRequest(job, step[1], 3, seq=len(jobs))
        elif step[0] == "place":
            placed, inv = plan(wants.values(), inv)
            for p in placed:
                states.check(p.job_id, jobs[p.job_id], JobState.SCHEDULED)
                jobs[p.job_id] = JobState.SCHEDULED
                del wants[p.job_id]
        elif jobs:
            job = sorted(jobs)[step[1] % len(jobs)]
            target = step[2]
            if target == JobState.SCHEDULED or not states.allowed(jobs[job], target):
                continue  # SCHEDULED is reached only through placement
            jobs[job] = target
            if not states.holds_devices(target):
                inv = inv.release(job)
            if target == JobState.PENDING:
                wants[job] = PlacementRequest(job, 1, 3, seq=0)
            else:
                wants.pop(job, None)
        for job, state in jobs.items():
            held = inv.assigned(job)
            if states.is_terminal(state) or state == JobState.PENDING:
                assert held == set(), f"{job} is {state} but holds {held}"
            else:
                assert held, f"{job} is {state} but holds nothing"
