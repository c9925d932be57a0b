"""Elastic grow (issue 40 §3): a job running shrunk grows back to its whole size when the queue would give
it that placement now, as one of its own in queue order: its own devices plus the free capacity, never a
spare; a job ahead of it that fits, a blocked head or its quota hold it back (`placement.grow`)."""

from __future__ import annotations

from dataclasses import replace

from tests.unit.scheduler.test_elastic import request, where
from tests.unit.scheduler.test_placement import node
from vigil_scheduler.placement import Inventory, NodeState, PlacementRequest, Slot, grow, plan
from vigil_scheduler.quotas import Ledger, Quotas

ON_A = (("a", 0), ("a", 1))  # the shrunk attempt of a two-node job: node a's 2 devices


def running(name: str, job: str = "j", n: int = 2, *, sick: tuple[int, ...] = ()) -> NodeState:
    """A node whose devices run `job` (its worker reports them busy)."""
    return NodeState(
        name=name,
        devices=tuple(
            Slot(index=i, healthy=i not in sick, reported_free=False, job_id=job) for i in range(n)
        ),
    )


def shrunk(**kw) -> PlacementRequest:
    """The job at its whole size (2 nodes of 2), holding node a's devices as it runs shrunk."""
    return request("j", 2, shrink=(1,), held=ON_A, **kw)


def test_it_grows_on_its_own_devices_and_the_node_that_came_back():
    inv = Inventory((running("a"), node("b", 2)))
    fit = grow(shrunk(), [], inv)
    assert fit is not None and len(fit.ranks) == 4
    assert where([fit]) == [("j", [(0, "a", 0, 0), (1, "a", 1, 1), (2, "b", 0, 0), (3, "b", 1, 1)])]


def test_no_room_no_growth():
    inv = Inventory((running("a"), node("b", 2, busy=(0,))))  # b came back, but half of it is taken
    assert grow(shrunk(), [], inv) is None


def test_never_on_a_spare():
    inv = Inventory((running("a"), node("b", 2)))  # b is whole and free: the reserve takes it
    assert grow(shrunk(), [], inv, spares=1) is None
    three = Inventory((running("a"), node("b", 2), node("s", 2)))  # b and s free: s is the spare
    fit = grow(shrunk(), [], three, spares=1)
    assert fit is not None and sorted(fit.nodes) == ["a", "b"]


def test_a_job_ahead_of_it_that_fits_takes_the_room_first():
    inv = Inventory((running("a"), node("b", 2)))
    ahead = replace(request("urgent", 1), priority=5)  # higher priority, fits on b
    assert grow(shrunk(seq=3), [ahead], inv) is None
    earlier = request("earlier", 1, seq=1)  # same priority, submitted before the growing job
    assert grow(shrunk(seq=3), [earlier], inv) is None


def test_a_job_behind_it_does_not():
    inv = Inventory((running("a"), node("b", 2)))
    later = request("later", 1, seq=9)
    lower = replace(request("lower", 1, seq=0), priority=-1)
    fit = grow(shrunk(seq=3), [later, lower], inv)
    assert fit is not None and len(fit.ranks) == 4


def test_a_blocked_head_holds_it_up_as_it_holds_any_job():
    # head wants 3 nodes: it fits once c frees, so the jobs behind it wait; the growth is one of them
    inv = Inventory((running("a"), node("b", 2), node("c", 2, busy=(0, 1))))
    head = request("head", 3, seq=0)
    assert grow(shrunk(seq=3), [head], inv) is None


def test_its_quota_holds_it_back():
    inv = Inventory((running("a"), node("b", 2)))
    req = replace(shrunk(), owner="u")
    assert grow(req, [], inv, Ledger(Quotas(users={"u": 3}))) is None  # 4 devices at its whole size
    assert grow(req, [], inv, Ledger(Quotas(users={"u": 4}))) is not None


def test_a_job_whose_device_fails_does_not_grow():
    inv = Inventory((running("a", sick=(1,)), node("b", 2), node("c", 2)))
    assert grow(shrunk(), [], inv) is None


def test_the_placement_after_the_decision_takes_it_whole_or_shrunk_on_its_own_devices_again():
    """The grow's next attempt is queued holding its devices (ROLLING_BACK): the pass that follows places
    it whole; where a job that came meanwhile, ahead of it, took the room, it goes on shrunk where it was
    (never left waiting)."""
    queued = request("j", 2, shrink=(1,), held=ON_A, seq=3)  # its previous placement: the shrunk one
    inv = Inventory((running("a"), node("b", 2)))
    placed, _ = plan([queued], inv)
    assert len(placed[0].ranks) == 4
    ahead = replace(request("urgent", 1, seq=4), priority=5)
    placed, _ = plan([queued, ahead], inv)
    assert where(placed) == [
        ("urgent", [(0, "b", 0, 0), (1, "b", 1, 1)]),
        ("j", [(0, "a", 0, 0), (1, "a", 1, 1)]),
    ]
