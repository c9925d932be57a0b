"""GPU quotas per user and team, pure: refused at submit when a job alone exceeds one, held in the queue
at placement (with the reason) when running jobs use it up, never holding up another team's job, and a
job's own earlier devices never counted against it."""

from __future__ import annotations

from vigil_scheduler.placement import Inventory, NodeState, PlacementRequest, Slot, plan
from vigil_scheduler.quotas import Holding, Ledger, Quotas, alone_exceeds


def cluster(n: int = 8) -> Inventory:
    return Inventory((NodeState(name="a", devices=tuple(Slot(index=i) for i in range(n))),))


def req(job: str, n: int, owner: str, team: str | None = None, *, seq: int = 0, priority: int = 0):
    return PlacementRequest(
        job_id=job, world_size=n, max_nodes=1, owner=owner, team=team, seq=seq, priority=priority
    )


QUOTAS = Quotas(users={"alice": 4}, teams={"vision": 6})


def test_a_job_alone_over_a_quota_is_refused_naming_the_quota() -> None:
    assert alone_exceeds("alice", "vision", 4, QUOTAS) is None
    assert alone_exceeds("alice", "vision", 5, QUOTAS) == (
        "the job needs 5 GPUs, more than user alice's quota of 4 GPUs at once"
    )
    assert alone_exceeds("bob", "vision", 7, QUOTAS) == (
        "the job needs 7 GPUs, more than team vision's quota of 6 GPUs at once"
    )
    assert alone_exceeds("carol", None, 1000, QUOTAS) is None  # no quota: no limit
    assert alone_exceeds("dan", "nlp", 1, Quotas(teams={"nlp": 0})) is not None  # zero: nothing runs


def test_running_jobs_use_up_the_teams_quota_and_the_next_one_waits_with_the_reason() -> None:
    ledger = Ledger(QUOTAS, [Holding("j-a", "alice", "vision", 4)])
    placed, _ = plan([req("j-b", 4, "bob", "vision", seq=1)], cluster(), ledger)
    assert placed == []
    assert ledger.waiting == {"j-b": "quota: team vision uses 4 of 6 GPUs; this job needs 4"}
    ledger = Ledger(QUOTAS, [Holding("j-a", "alice", "vision", 4)])
    placed, _ = plan([req("j-b", 2, "bob", "vision", seq=1)], cluster(), ledger)  # 4 + 2 = 6: fits
    assert [p.job_id for p in placed] == ["j-b"] and ledger.waiting == {}


def test_the_users_own_quota_is_checked_before_the_teams() -> None:
    ledger = Ledger(QUOTAS, [Holding("j-a", "alice", "vision", 3)])
    assert (
        ledger.refusal("j-b", "alice", "vision", 2) == "quota: user alice uses 3 of 4 GPUs; this job needs 2"
    )


def test_jobs_placed_in_one_pass_count_against_the_quota_of_the_next() -> None:
    ledger = Ledger(QUOTAS)
    queue = [req("j-1", 3, "alice", seq=1), req("j-2", 2, "alice", seq=2), req("j-3", 1, "alice", seq=3)]
    placed, _ = plan(queue, cluster(), ledger)
    assert [p.job_id for p in placed] == ["j-1", "j-3"]  # 3, then 3 + 2 > 4 waits, 3 + 1 = 4 fits
    assert ledger.waiting == {"j-2": "quota: user alice uses 3 of 4 GPUs; this job needs 2"}


def test_a_job_held_by_its_quota_holds_up_no_other_teams_job() -> None:
    ledger = Ledger(QUOTAS, [Holding("j-a", "alice", "vision", 6)])
    queue = [req("j-big", 2, "bob", "vision", seq=1, priority=100), req("j-nlp", 2, "carol", "nlp", seq=2)]
    placed, _ = plan(queue, cluster(), ledger)
    assert [p.job_id for p in placed] == ["j-nlp"] and set(ledger.waiting) == {"j-big"}


def test_a_relaunch_does_not_count_its_own_devices_against_it() -> None:
    # a restart is queued again while its devices are still assigned to it: they are its own to reuse
    ledger = Ledger(QUOTAS, [Holding("j-a", "alice", "vision", 4)])
    assert ledger.refusal("j-a", "alice", "vision", 4) is None


def test_without_a_ledger_or_quotas_placement_is_unchanged() -> None:
    queue = [req("j-1", 8, "alice", seq=1), req("j-2", 1, "bob", seq=2)]
    assert [p.job_id for p in plan(queue, cluster())[0]] == ["j-1"]
    assert [p.job_id for p in plan(queue, cluster(), Ledger(Quotas()))[0]] == ["j-1"]
