"""The queue in words: position, why each job waits, and its estimated start from the reservations."""

from __future__ import annotations

from datetime import UTC, datetime

from vigil_scheduler.backfill import Running
from vigil_scheduler.fairshare import standings
from vigil_scheduler.placement import Inventory, NodeState, PlacementRequest, Slot
from vigil_scheduler.queueview import at, explain, forecast
from vigil_scheduler.quotas import Ledger, Quotas

NOW = datetime(2026, 11, 28, 13, 5, tzinfo=UTC).timestamp()
H = 3600.0


def node(name: str, n: int = 8, busy: dict[int, str] | None = None) -> NodeState:
    held = busy or {}
    return NodeState(
        name=name,
        devices=tuple(Slot(index=i, job_id=held.get(i), reported_free=i not in held) for i in range(n)),
    )


def req(job: str, world: int, seq: int, limit: float | None = None, **kw: object) -> PlacementRequest:
    return PlacementRequest(job_id=job, world_size=world, max_nodes=1, seq=seq, time_limit=limit, **kw)  # type: ignore[arg-type]


# One 8-GPU node: r-a holds 4 until 14:05, r-b holds 2 until 15:05; 2 are free.
CLUSTER = Inventory((node("a", busy={0: "r-a", 1: "r-a", 2: "r-a", 3: "r-a", 4: "r-b", 5: "r-b"}),))
RUNNING = (
    Running("r-a", frozenset(("a", i) for i in range(4)), NOW + H),
    Running("r-b", frozenset([("a", 4), ("a", 5)]), NOW + 2 * H),
)


def test_each_waiting_job_says_its_position_why_and_when() -> None:
    queue = [
        req("j-big", 8, seq=1, priority=5, limit=H),
        req("j-short", 2, seq=2, limit=1800),
        req("j-long", 4, seq=3, limit=4 * H),
    ]
    entries = {e.job_id: e for e in explain(queue, CLUSTER, NOW, RUNNING)}
    big, short, long = entries["j-big"], entries["j-short"], entries["j-long"]
    assert [big.position, short.position, long.position] == [1, 2, 3]
    assert big.reserved and big.reason == "needs 8 GPUs on one node; reserved for j-big from 15:05 UTC"
    assert big.estimated_start == NOW + 2 * H
    assert short.starting and short.estimated_start == NOW  # ends at 13:35, before the reservation
    assert long.reason.startswith("behind j-big, which is reserved from 15:05 UTC; its time limit (4h)")
    assert long.estimated_start == NOW + 3 * H  # once j-big, on the whole node from 15:05, has ended
    assert forecast(queue[2:], CLUSTER, NOW, RUNNING) == {"j-long": NOW + H}  # alone: when r-a ends


def test_a_quota_reason_and_an_over_share_team_are_said() -> None:
    queue = [req("j-q", 2, seq=1, owner="bob", team="vision"), req("j-n", 2, seq=2, team="nlp")]
    ledger = Ledger(Quotas(teams={"vision": 1}))
    standing = standings({}, {"nlp": 9.0, "vision": 1.0})
    entries = explain(queue, CLUSTER, NOW, RUNNING, ledger=ledger, standing=standing)
    assert entries[0].reason == "quota: team vision uses 0 of 1 GPUs; this job needs 2"
    assert entries[0].estimated_start is None
    assert entries[1].starting and entries[1].reason == "starts in the next placement pass"
    blocked = explain([req("j-n", 4, seq=2, team="nlp")], CLUSTER, NOW, RUNNING, standing=standing)
    assert blocked[0].reason.endswith("; team nlp over its share (1.8x)")


def test_another_users_job_is_named_by_a_stand_in_and_no_limit_means_no_estimate() -> None:
    running = (Running("r-a", frozenset(("a", i) for i in range(6)), None),)
    queue = [req("j-big", 8, seq=1), req("j-mine", 4, seq=2, limit=60)]
    entries = explain(
        queue, CLUSTER, NOW, running, name=lambda j: j if j == "j-mine" else "another user's job"
    )
    assert entries[0].reason.endswith(
        "reserved for another user's job once running jobs without a time limit free enough devices"
    )
    assert entries[1].reason == "behind another user's job, which waits for running jobs without a time limit"
    assert [e.estimated_start for e in entries] == [None, None]


def test_a_job_too_big_for_the_cluster_says_so() -> None:
    (entry,) = explain([req("j-huge", 16, seq=1)], CLUSTER, NOW, RUNNING)
    assert entry.reason == "needs 16 GPUs on one node: more than the healthy cluster holds"
    assert entry.estimated_start is None


def test_times_on_another_day_carry_the_date() -> None:
    assert at(NOW + 3 * H, NOW) == "16:05 UTC"
    assert at(NOW + 24 * H, NOW) == "2026-11-29 13:05 UTC"
