"""Hot spares (issue 40 §1): whole free nodes held in reserve for a running job that loses a node or a
device. The queue's placements never use them; such a job takes one when free capacity does not hold it,
even behind a blocked head job; the reserve refills from freed capacity before the queue sees it."""

from __future__ import annotations

from tests.unit.scheduler.test_placement import node
from vigil_scheduler.placement import Inventory, PlacementRequest, lost_capacity, plan, spare_nodes


def request(
    job: str, world: int, *, held: tuple[tuple[str, int], ...] = (), seq: int = 0
) -> PlacementRequest:
    return PlacementRequest(job_id=job, world_size=world, max_nodes=4, seq=seq, reusable=frozenset(held))


def on(placement) -> list[str]:
    return placement.nodes


HELD_A_B = (("a", 0), ("a", 1), ("b", 0), ("b", 1))  # a two-node job's previous attempt


def test_the_reserve_is_the_last_whole_free_nodes_and_short_when_there_are_none():
    inv = Inventory((node("a", 2), node("b", 2, busy=(0,)), node("c", 2), node("d", 2, sick=(1,))))
    assert spare_nodes(inv, 0) == frozenset()
    assert spare_nodes(inv, 1) == {"c"}  # d has a sick device, b a busy one: not whole
    assert spare_nodes(inv, 5) == {"a", "c"}  # short of five: what there is


def test_the_queue_never_places_on_a_spare():
    inv = Inventory((node("a", 2), node("b", 2), node("s", 2)))
    placed, _ = plan([request("big", 6), request("small", 4, seq=1)], inv, spares=1)
    # "big" needs the spare to fit at all: it waits, and blocks nobody (it can never fit beside a spare)
    assert [(p.job_id, on(p)) for p in placed] == [("small", ["a", "b"])]


def test_a_job_that_lost_a_node_takes_the_spare_with_the_node_it_kept():
    inv = Inventory((node("a", 2), node("s", 2)))  # b is lost: gone from the inventory
    req = request("j", 4, held=HELD_A_B)
    assert lost_capacity(req, inv)
    placed, _ = plan([req], inv, spares=1)
    assert [(p.job_id, sorted(on(p))) for p in placed] == [("j", ["a", "s"])]


def test_a_job_whose_device_was_marked_unhealthy_takes_the_spare():
    inv = Inventory((node("a", 2), node("b", 2, sick=(1,)), node("s", 2)))
    req = request("j", 4, held=HELD_A_B)
    assert lost_capacity(req, inv)
    placed, _ = plan([req], inv, spares=1)
    assert sorted(on(placed[0])) == ["a", "s"]


def test_a_job_that_lost_nothing_never_takes_a_spare():
    inv = Inventory((node("a", 2), node("b", 2, busy=(0, 1)), node("s", 2)))  # its b went to another job
    req = request("crashed", 4, held=HELD_A_B)
    assert not lost_capacity(req, inv)
    placed, _ = plan([req], inv, spares=1)
    assert placed == []


def test_free_capacity_is_taken_before_the_spare():
    inv = Inventory((node("a", 2), node("c", 2), node("s", 2)))
    placed, after = plan([request("j", 4, held=HELD_A_B)], inv, spares=1)
    assert sorted(on(placed[0])) == ["a", "c"]
    assert spare_nodes(after, 1) == {"s"}  # still in reserve


def test_a_blocked_head_job_does_not_hold_up_a_job_taking_a_spare():
    inv = Inventory((node("a", 2), node("c", 2, busy=(0, 1)), node("s", 2)))
    head = request("head", 4, seq=0)  # fits once c frees: it blocks the queue behind it
    small = request("small", 2, seq=1)  # would fit on a, but waits behind the head
    lost = request("lost", 4, held=HELD_A_B, seq=2)
    placed, _ = plan([head, small, lost], inv, spares=1)
    # behind the head, the job that lost b takes the spare and the node it kept (a), nothing free else
    assert [(p.job_id, sorted(on(p))) for p in placed] == [("lost", ["a", "s"])]


def test_the_reserve_refills_from_freed_capacity_before_the_queue():
    taken = Inventory((node("a", 2, busy=(0, 1)), node("s", 2, busy=(0, 1))))  # the spare was taken
    assert spare_nodes(taken, 1) == frozenset()
    freed = Inventory((node("a", 2), node("s", 2, busy=(0, 1))))  # then a job on a ended
    placed, _ = plan([request("queued", 2)], freed, spares=1)
    assert placed == [] and spare_nodes(freed, 1) == {"a"}
