"""Elastic shrink (issue 40 §3): a job with `resources.elastic` that lost a node, and fits neither on free
capacity nor on a spare, continues on fewer nodes: the largest count it allows (never below min_nodes,
never one that breaks its integer gradient accumulation), on the nodes it held first."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.unit.scheduler.test_placement import node
from tests.unit.scheduler.test_placement_properties import inventories
from vigil_scheduler.placement import Inventory, PlacementRequest, may_shrink, plan
from vigil_scheduler.quotas import Ledger, Quotas

HELD_A_B = (("a", 0), ("a", 1), ("b", 0), ("b", 1))  # a two-node job's previous attempt, 2 devices a node


def held(*names: str, per_node: int = 2) -> tuple[tuple[str, int], ...]:
    return tuple((n, i) for n in names for i in range(per_node))


def request(
    job: str,
    nodes: int,
    *,
    shrink: tuple[int, ...] = (),
    held: tuple[tuple[str, int], ...] = (),
    seq: int = 0,
    per_node: int = 2,
) -> PlacementRequest:
    return PlacementRequest(
        job_id=job,
        world_size=nodes * per_node,
        max_nodes=nodes,
        seq=seq,
        reusable=frozenset(held),
        shrink_nodes=shrink,
    )


def where(placed) -> list[tuple[str, list[tuple[int, str, int, int]]]]:
    return [(p.job_id, [(r.rank, r.node, r.device, r.local_rank) for r in p.ranks]) for p in placed]


def test_with_no_spare_and_no_free_node_it_continues_on_the_survivor():
    inv = Inventory((node("a", 2), node("c", 2, busy=(0, 1))))  # b is lost; c is another job's
    req = request("j", 2, shrink=(1,), held=HELD_A_B)
    assert may_shrink(req, inv)
    placed, after = plan([req], inv)
    # ranks 0..W'-1 on the node it kept: world 2 of the 4 it asks for
    assert where(placed) == [("j", [(0, "a", 0, 0), (1, "a", 1, 1)])]
    assert after.assigned("j") == {("a", 0), ("a", 1)}


def test_a_job_that_is_not_elastic_waits_as_before():
    inv = Inventory((node("a", 2), node("c", 2, busy=(0, 1))))
    assert plan([request("j", 2, held=HELD_A_B)], inv)[0] == []


def test_a_spare_beats_a_shrink():
    inv = Inventory((node("a", 2), node("s", 2)))
    placed, _ = plan([request("j", 2, shrink=(1,), held=HELD_A_B)], inv, spares=1)
    assert sorted(placed[0].nodes) == ["a", "s"] and len(placed[0].ranks) == 4


def test_free_capacity_beats_a_shrink():
    inv = Inventory((node("a", 2), node("c", 2)))
    placed, _ = plan([request("j", 2, shrink=(1,), held=HELD_A_B)], inv)
    assert sorted(placed[0].nodes) == ["a", "c"] and len(placed[0].ranks) == 4


def test_a_spare_with_the_survivors_makes_a_larger_shrink_than_the_survivors_alone():
    # four nodes asked for, c and d lost, one spare: 3 nodes (a, b, s) rather than 2
    inv = Inventory((node("a", 2), node("b", 2), node("s", 2)))
    req = request("j", 4, shrink=(3, 2, 1), held=held("a", "b", "c", "d"))
    placed, _ = plan([req], inv, spares=1)
    assert sorted(placed[0].nodes) == ["a", "b", "s"] and len(placed[0].ranks) == 6


def test_never_below_min_nodes():
    # four nodes asked for, min_nodes 3 (shrink_nodes (3,)): two survivors are not enough
    inv = Inventory((node("a", 2), node("b", 2), node("x", 2, busy=(0, 1))))
    assert plan([request("j", 4, shrink=(3,), held=held("a", "b", "c", "d"))], inv)[0] == []


def test_never_a_count_that_breaks_the_integer_gradient_accumulation():
    # four nodes, grad_accum 1: 3 nodes would need 4/3 micro-batches each, so shrink_nodes is (2, 1):
    # with three survivors it runs on two of them
    inv = Inventory((node("a", 2), node("b", 2), node("c", 2)))
    placed, _ = plan([request("j", 4, shrink=(2, 1), held=held("a", "b", "c", "d"))], inv)
    assert len(placed[0].nodes) == 2 and len(placed[0].ranks) == 4
    assert set(placed[0].nodes) <= {"a", "b", "c"}


def test_a_shrink_prefers_the_nodes_it_held_over_free_ones():
    # four nodes asked for, c and d lost; f is free but one node short of the whole job. Placed first in
    # the inventory, f would be taken by a plain placement: the shrink keeps to the survivors a and b
    inv = Inventory((node("f", 2), node("a", 2), node("b", 2)))
    placed, _ = plan([request("j", 4, shrink=(2, 1), held=held("a", "b", "c", "d"))], inv)
    assert placed[0].nodes == ["a", "b"]


def test_a_shrink_takes_free_capacity_where_the_survivors_do_not_hold_it():
    # three nodes asked for, b and c lost, f free: two nodes (a and f) rather than one
    inv = Inventory((node("a", 2), node("f", 2)))
    placed, _ = plan([request("j", 3, shrink=(2, 1), held=held("a", "b", "c"))], inv)
    assert sorted(placed[0].nodes) == ["a", "f"]


def test_a_blocked_head_job_does_not_hold_up_a_shrink():
    inv = Inventory((node("a", 2), node("f", 2), node("c", 2, busy=(0, 1))))
    head = request("head", 3, seq=0)  # fits once c frees: it blocks the queue behind it
    small = request("small", 1, seq=1)  # would fit on f, but waits behind the head
    lost = request("lost", 2, shrink=(1,), held=HELD_A_B, seq=2)
    placed, _ = plan([head, small, lost], inv)
    # behind the head, the job that lost b continues on the node it kept, and takes no free capacity
    assert where(placed) == [("lost", [(0, "a", 0, 0), (1, "a", 1, 1)])]


def test_behind_a_blocked_head_a_shrink_uses_only_its_own_nodes_and_the_spares():
    # three nodes asked for, b and c lost; f is free but the head waits for it
    inv = Inventory((node("a", 2), node("f", 2), node("c", 2, busy=(0, 1))))
    head = request("head", 3, seq=0)
    lost = request("lost", 3, shrink=(2, 1), held=held("a", "b", "x"), seq=1)
    placed, _ = plan([head, lost], inv)
    assert [(p.job_id, p.nodes) for p in placed] == [("lost", ["a"])]


def test_a_job_that_lost_nothing_does_not_shrink():
    inv = Inventory((node("a", 2), node("b", 2, busy=(0, 1))))  # its b went to another job
    req = request("crashed", 2, shrink=(1,), held=HELD_A_B)
    assert not may_shrink(req, inv)
    assert plan([req], inv)[0] == []


def test_a_job_running_shrunk_grows_back_when_requeued_with_room_and_stays_shrunk_without():
    shrunk = request("j", 2, shrink=(1,), held=(("a", 0), ("a", 1)))  # its last attempt ran on a alone
    full = Inventory((node("a", 2), node("b", 2, busy=(0, 1))))
    assert may_shrink(shrunk, full)
    assert where(plan([shrunk], full)[0]) == [("j", [(0, "a", 0, 0), (1, "a", 1, 1)])]
    room = Inventory((node("a", 2), node("b", 2)))
    assert len(plan([shrunk], room)[0][0].ranks) == 4


def test_a_quota_counts_the_devices_a_shrink_holds():
    inv = Inventory((node("a", 2), node("c", 2, busy=(0, 1))))
    ledger = Ledger(Quotas(users={"u": 4}))
    req = PlacementRequest(
        job_id="j", world_size=4, max_nodes=2, reusable=frozenset(HELD_A_B), shrink_nodes=(1,), owner="u"
    )
    plan([req], inv, ledger)
    assert ledger.refusal("other", "u", None, 2) is None  # the shrunk job holds 2 of u's 4


@pytest.mark.parametrize(
    ("world", "max_nodes", "shrink"),
    [(5, 2, (1,)), (4, 2, (2,)), (4, 2, (0,)), (8, 4, (1, 2)), (8, 4, (2, 2))],
)
def test_a_request_refuses_shrink_counts_that_make_no_sense(world, max_nodes, shrink):
    with pytest.raises(ValueError):
        PlacementRequest(job_id="j", world_size=world, max_nodes=max_nodes, shrink_nodes=shrink)


@st.composite
def elastic_requests(draw: st.DrawFn) -> PlacementRequest:
    nodes = draw(st.integers(2, 5))
    per_node = draw(st.integers(1, 4))
    counts = draw(st.sets(st.integers(1, nodes - 1), min_size=1))
    held_nodes = draw(st.sets(st.sampled_from([f"n{i}" for i in range(7)]), min_size=1, max_size=nodes))
    return PlacementRequest(
        job_id="j",
        world_size=nodes * per_node,
        max_nodes=nodes,
        reusable=frozenset((n, d) for n in held_nodes for d in range(per_node)),
        shrink_nodes=tuple(sorted(counts, reverse=True)),
    )


@settings(max_examples=300, deadline=None)
@given(inventories(), elastic_requests(), st.integers(0, 2))
def test_an_elastic_placement_is_whole_or_an_allowed_smaller_gang(inv, req, spares):
    placed, after = plan([req], inv, spares=spares)
    if not placed:
        return
    (p,) = placed
    per_node = req.world_size // req.max_nodes
    size = len(p.ranks)
    assert [r.rank for r in p.ranks] == list(range(size))  # ranks 0..W'-1
    assert size == req.world_size or (
        size // per_node in req.shrink_nodes and size % per_node == 0 and may_shrink(req, inv)
    )
    assert len(p.nodes) <= size // per_node
    for r in p.ranks:  # only devices it may use: free, or its own previous attempt's
        node = inv.node(r.node)
        assert node is not None and node.alive
        slot = next(d for d in node.devices if d.index == r.device)
        assert slot.healthy and slot.job_id in (None, "j")
    assert after.assigned("j") == p.devices
