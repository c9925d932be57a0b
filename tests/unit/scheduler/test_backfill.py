"""EASY backfill in `plan`: the blocked head's reservation from the running jobs' time limits, and the jobs
behind it that start now because they end before it or use none of its devices."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from vigil_scheduler.backfill import Backfill, Reservation, Running, fits_behind, freed, reserve
from vigil_scheduler.placement import Inventory, NodeState, PlacementRequest, Slot, place, plan

NOW = 1_000_000.0


def node(name: str, n: int = 4, busy: dict[int, str] | None = None) -> NodeState:
    held = busy or {}
    devices = tuple(Slot(index=i, job_id=held.get(i), reported_free=i not in held) for i in range(n))
    return NodeState(name=name, devices=devices)


def req(job: str, world: int, *, seq: int, limit: float | None = None, max_nodes: int = 1, **kw: object):
    return PlacementRequest(
        job_id=job,
        world_size=world,
        max_nodes=max_nodes,
        seq=seq,
        time_limit=limit,
        **kw,  # type: ignore[arg-type]
    )


def running(job: str, devices: list[tuple[str, int]], ends_in: float | None) -> Running:
    return Running(job, frozenset(devices), None if ends_in is None else NOW + ends_in)


# Two 4-device nodes: "a" runs r-long (all 4, ends in 2 h), "b" runs r-short on 2 devices (ends in 1 h).
CLUSTER = Inventory(
    (node("a", busy={i: "r-long" for i in range(4)}), node("b", busy={0: "r-short", 1: "r-short"}))
)
RUNNING = (
    running("r-long", [("a", i) for i in range(4)], 7200),
    running("r-short", [("b", 0), ("b", 1)], 3600),
)


def test_the_head_is_reserved_from_the_earliest_time_enough_devices_free_up() -> None:
    head = req("head", 4, seq=1)
    clock = Backfill(now=NOW, running=RUNNING)
    placed, _ = plan([head], CLUSTER, backfill=clock)
    assert placed == []
    assert clock.reservation == Reservation(head, NOW + 3600, frozenset(("b", i) for i in range(4)))


def test_a_job_that_ends_before_the_reservation_starts_now_on_the_reserved_devices() -> None:
    clock = Backfill(now=NOW, running=RUNNING)
    queue = [req("head", 4, seq=1), req("short", 2, seq=2, limit=1800)]
    placed, _ = plan(queue, CLUSTER, backfill=clock)
    assert [(p.job_id, sorted(p.devices)) for p in placed] == [("short", [("b", 2), ("b", 3)])]
    assert clock.backfilled == {"short": True}


def test_a_long_job_waits_when_it_needs_reserved_devices() -> None:
    clock = Backfill(now=NOW, running=RUNNING)
    queue = [req("head", 4, seq=1), req("long", 2, seq=2, limit=7200), req("forever", 1, seq=3)]
    placed, _ = plan(queue, CLUSTER, backfill=clock)
    assert placed == []  # both would hold b:2-3, which the head needs at NOW + 1 h
    assert clock.reservation is not None and clock.reservation.job_id == "head"


def test_a_long_job_starts_now_on_devices_the_reservation_does_not_need() -> None:
    cluster = Inventory((*CLUSTER.nodes, node("c", 2)))
    clock = Backfill(now=NOW, running=RUNNING)
    queue = [req("head", 4, seq=1), req("forever", 2, seq=2)]  # no limit: never ends
    placed, _ = plan(queue, cluster, backfill=clock)
    assert [(p.job_id, sorted(p.devices)) for p in placed] == [("forever", [("c", 0), ("c", 1)])]
    assert clock.backfilled == {"forever": False}


def test_without_time_limits_the_blocked_head_holds_up_the_queue_as_before() -> None:
    clock = Backfill(now=NOW, running=(running("r-long", [("a", i) for i in range(4)], None),))
    cluster = Inventory((node("a", busy={i: "r-long" for i in range(4)}), node("b", 2)))
    queue = [req("head", 4, seq=1), req("short", 1, seq=2, limit=60)]
    placed, _ = plan(queue, cluster, backfill=clock)
    assert placed == []
    assert clock.reservation == Reservation(queue[0], None)
    assert plan(queue, cluster)[0] == []  # no clock given: the same strict queue


def test_jobs_placed_earlier_in_the_pass_count_as_running_until_their_limit() -> None:
    cluster = Inventory((node("a", 4),))
    clock = Backfill(now=NOW)
    queue = [req("first", 2, seq=1, limit=600), req("head", 4, seq=2), req("short", 2, seq=3, limit=700)]
    placed, _ = plan(queue, cluster, backfill=clock)
    assert [p.job_id for p in placed] == ["first"]  # "short" would end after "head"'s reservation
    assert clock.reservation is not None and clock.reservation.start == NOW + 600


def test_an_overdue_job_frees_its_devices_now_as_far_as_the_reservation_goes() -> None:
    overdue = (running("r-long", [("a", i) for i in range(4)], -30),)
    reservation = reserve(req("head", 4, seq=1), CLUSTER, overdue, NOW)
    assert reservation.start == NOW and len(reservation.devices) == 4


def test_a_job_that_never_fits_gets_no_reservation_and_blocks_nobody() -> None:
    clock = Backfill(now=NOW, running=RUNNING)
    queue = [req("huge", 16, seq=1, max_nodes=2), req("small", 2, seq=2)]
    placed, _ = plan(queue, CLUSTER, backfill=clock)
    assert [p.job_id for p in placed] == ["small"] and clock.reservation is None


def test_fits_behind_says_nothing_without_a_reservation_time() -> None:
    assert (
        fits_behind(req("x", 1, seq=2, limit=1), CLUSTER, Reservation(req("h", 4, seq=1), None), NOW) is None
    )


def test_equal_priorities_go_by_fair_share_factor_then_submission_order() -> None:
    cluster = Inventory((node("a", 2),))
    queue = [
        req("heavy-team", 2, seq=1, share_factor=0.25),
        req("light-team", 2, seq=2, share_factor=0.9),
        req("urgent", 2, seq=3, share_factor=0.1, priority=5),
    ]
    assert [p.job_id for p in plan(queue, cluster)[0]] == ["urgent"]
    assert [p.job_id for p in plan(queue[:2], cluster)[0]] == ["light-team"]


@settings(max_examples=120, deadline=None)
@given(
    ends=st.lists(st.integers(min_value=-100, max_value=10_000), min_size=4, max_size=12),
    world=st.integers(min_value=1, max_value=16),
    max_nodes=st.integers(min_value=1, max_value=4),
    sick=st.sets(st.integers(min_value=0, max_value=15), max_size=4),
    dead=st.sampled_from([None, "n0", "n3"]),
    reusable=st.sets(st.integers(min_value=0, max_value=15), max_size=3),
)
def test_the_reservation_is_the_first_end_after_which_place_succeeds(
    ends: list[int], world: int, max_nodes: int, sick: set[int], dead: str | None, reusable: set[int]
):
    # Four 4-device nodes; each running job holds devices round-robin over them; half end, some never do.
    # Some devices unhealthy, maybe a node dead, and the head may have devices of its own to reuse.
    owner = {(f"n{i % 4}", i // 4): f"r{i % len(ends)}" for i in range(16)}
    cluster = Inventory(
        tuple(
            NodeState(
                f"n{n}",
                tuple(
                    Slot(
                        index=i,
                        job_id=owner[(f"n{n}", i)],
                        reported_free=False,
                        healthy=n * 4 + i not in sick,
                    )
                    for i in range(4)
                ),
                alive=f"n{n}" != dead,
            )
            for n in range(4)
        )
    )
    jobs = [
        Running(
            f"r{j}",
            frozenset(d for d, o in owner.items() if o == f"r{j}"),
            None if end % 3 == 0 else NOW + end,
        )
        for j, end in enumerate(ends)
    ]
    head = req(
        "head", world, seq=1, max_nodes=max_nodes, reusable=frozenset((f"n{i % 4}", i // 4) for i in reusable)
    )
    got = reserve(head, cluster, jobs, NOW)
    expected, inventory = None, cluster  # the reference: free one job at a time, in end order, and try
    for job in sorted((j for j in jobs if j.ends_at is not None), key=lambda j: (j.ends_at, j.job_id)):
        inventory = freed(inventory, job.devices)
        if (fit := place(head, inventory)) is not None:
            expected = (max(NOW, job.ends_at), frozenset(fit.devices))
            break
    assert (got.start, got.devices) == (expected or (None, frozenset()))
