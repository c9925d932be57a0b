"""Placement: gang, fewest nodes, packed, NVLink-aware, never on unhealthy or busy devices."""

from __future__ import annotations

import pytest

from vigil_scheduler.placement import (
    Inventory,
    NodeState,
    Placement,
    PlacementRequest,
    RankSlot,
    Slot,
    fits_ever,
    place,
    plan,
)


def node(
    name: str,
    n: int = 8,
    *,
    busy: tuple[int, ...] = (),
    sick: tuple[int, ...] = (),
    alive: bool = True,
    nvlink: dict[int, set[int]] | None = None,
    kind: str = "gpu",
) -> NodeState:
    links = nvlink or {}
    return NodeState(
        name=name,
        alive=alive,
        devices=tuple(
            Slot(
                index=i,
                kind=kind,
                healthy=i not in sick,
                job_id="other" if i in busy else None,
                nvlink=frozenset(links.get(i, set())),
            )
            for i in range(n)
        ),
    )


def req(world: int, max_nodes: int = 64, job: str = "j1", **kw: object) -> PlacementRequest:
    return PlacementRequest(job_id=job, world_size=world, max_nodes=max_nodes, **kw)  # type: ignore[arg-type]


def test_single_node_best_fit_keeps_big_nodes_whole() -> None:
    inv = Inventory((node("a"), node("b", busy=(0, 1, 2, 3, 4, 5)), node("c", busy=(0, 1, 2, 3))))
    p = place(req(2), inv)
    assert p is not None
    assert p.nodes == ["b"] and sorted(p.devices) == [("b", 6), ("b", 7)]


def test_ranks_are_ordered_with_local_ranks_per_node() -> None:
    inv = Inventory((node("a", 4), node("b", 4)))
    p = place(req(8, max_nodes=2), inv)
    assert p is not None
    assert [(r.rank, r.node, r.local_rank) for r in p.ranks] == [
        (0, "a", 0),
        (1, "a", 1),
        (2, "a", 2),
        (3, "a", 3),
        (4, "b", 0),
        (5, "b", 1),
        (6, "b", 2),
        (7, "b", 3),
    ]


def test_fewest_nodes_prefers_one_big_node() -> None:
    inv = Inventory((node("a", 4, busy=(0, 1)), node("b", 4, busy=(0, 1)), node("c", 8, busy=(0, 1, 2, 3))))
    p = place(req(4, max_nodes=2), inv)
    assert p is not None and p.nodes == ["c"]


def test_gang_all_or_none() -> None:
    inv = Inventory((node("a", 4, busy=(0,)), node("b", 4, busy=(0,))))
    assert place(req(7, max_nodes=2), inv) is None
    assert place(req(6, max_nodes=1), inv) is None  # 3 + 3 needs two nodes
    p = place(req(6, max_nodes=2), inv)
    assert p is not None and len(p.ranks) == 6


def test_never_on_unhealthy_dead_or_busy() -> None:
    inv = Inventory((node("a", 4, sick=(1,), busy=(2,)), node("b", 4, alive=False)))
    p = place(req(2), inv)
    assert p is not None and p.devices == {("a", 0), ("a", 3)}
    assert place(req(3), inv) is None


def test_worker_reported_busy_is_not_free_unless_the_job_held_it() -> None:
    n = NodeState("a", (Slot(0, reported_free=False), Slot(1, reported_free=False), Slot(2)))
    inv = Inventory((n,))
    assert place(req(2), inv) is None
    p = place(req(2, reusable=frozenset({("a", 0)})), inv)
    assert p is not None and p.devices == {("a", 0), ("a", 2)}


def test_nvlink_joined_devices_preferred() -> None:
    # 0-1 and 2-3 and 4-5 are NVLink pairs; 6 and 7 stand alone. Busy: 0 and 2.
    pairs = {0: {1}, 1: {0}, 2: {3}, 3: {2}, 4: {5}, 5: {4}}
    inv = Inventory((node("a", 8, busy=(0, 2), nvlink=pairs),))
    p = place(req(2), inv)
    assert p is not None and p.devices == {("a", 4), ("a", 5)}


def test_nvlink_breaks_ties_between_equally_good_nodes() -> None:
    island = {4: {5, 6, 7}, 5: {4, 6, 7}, 6: {4, 5, 7}, 7: {4, 5, 6}}
    inv = Inventory((node("a", 8, busy=(0, 2, 4, 6)), node("b", 8, busy=(0, 1, 2, 3), nvlink=island)))
    p = place(req(4), inv)
    assert p is not None and p.nodes == ["b"]


def test_cpu_nodes_take_lowest_indices() -> None:
    inv = Inventory((node("a", 4, kind="cpu"),))
    p = place(req(2), inv)
    assert p is not None and p.devices == {("a", 0), ("a", 1)}


def test_64_device_job_on_full_nodes() -> None:
    nodes = tuple(node(f"n{i:04d}", busy=(0,) if i % 2 else ()) for i in range(32))
    p = place(req(64, max_nodes=8), Inventory(nodes))
    assert p is not None and len(p.nodes) == 8 and len(p.devices) == 64


def test_assign_refuses_a_taken_device_and_release_frees() -> None:
    inv = Inventory((node("a", 2),))
    p = Placement("j1", (RankSlot(0, "a", 0, 0),))
    inv = inv.assign(p)
    with pytest.raises(ValueError, match="already belongs to job j1"):
        inv.assign(Placement("j2", (RankSlot(0, "a", 0, 0),)))
    assert inv.release("j1").assigned("j1") == set()


def test_plan_orders_by_priority_then_submission_and_blocks_behind_a_waiting_job() -> None:
    inv = Inventory((node("a", 4),))
    queue = [
        req(2, job="late", seq=3),
        req(2, job="first", seq=1),
        req(4, job="urgent", priority=5, seq=2),
    ]
    placed, _ = plan(queue, inv)
    assert [p.job_id for p in placed] == ["urgent"]  # "first" waits for room and "late" waits behind it

    queue = [req(2, job="first", seq=1), req(2, job="second", seq=2), req(1, job="third", seq=3)]
    placed, after = plan(queue, inv)
    assert [p.job_id for p in placed] == ["first", "second"]
    assert after.assigned("first").isdisjoint(after.assigned("second"))


def test_a_job_that_can_never_fit_blocks_nobody() -> None:
    inv = Inventory((node("a", 4, sick=(3,)),))
    assert not fits_ever(req(4), inv)
    placed, _ = plan([req(4, job="huge", seq=1), req(1, job="small", seq=2)], inv)
    assert [p.job_id for p in placed] == ["small"]


def test_request_validation_names_the_field() -> None:
    with pytest.raises(ValueError, match="world_size"):
        req(0)
