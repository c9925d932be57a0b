"""Preemption's victims: lower priority and preemptible only; the fewest GPUs that let the job be placed;
youngest first on ties; a team over its share first; None when no set lets the job be placed."""

from __future__ import annotations

from vigil_scheduler import preemption
from vigil_scheduler.placement import Inventory, NodeState, PlacementRequest, Slot
from vigil_scheduler.preemption import EXACT_UP_TO, Running, choose, freed, preemptible


def node(name: str, jobs: list[str | None], reported_free: bool = False) -> NodeState:
    """A node whose device i holds jobs[i] (None: free); a busy device is reported busy by its worker."""
    return NodeState(
        name=name,
        devices=tuple(
            Slot(index=i, job_id=j, reported_free=j is None or reported_free) for i, j in enumerate(jobs)
        ),
    )


def need(world: int, priority: int = 50, max_nodes: int = 1) -> PlacementRequest:
    return PlacementRequest(job_id="hi", world_size=world, max_nodes=max_nodes, priority=priority)


def run(
    job: str, priority: int = 10, *, started: float = 0.0, preemptible: bool = True, team: str | None = None
):
    return Running(job_id=job, priority=priority, preemptible=preemptible, started=started, team=team)


def victims(choice) -> list[str]:
    return sorted(r.job_id for r in choice.jobs) if choice else []


def test_the_fewest_gpus_that_let_the_job_fit() -> None:
    inv = Inventory((node("a", ["big"] * 4), node("b", ["s1", "s1", "s2", None])))
    running = [run("big", started=1), run("s1", started=2), run("s2", started=3)]
    assert victims(choose(need(2), inv, running)) == ["s2"]  # 1 GPU (with b's free one) beats s1's 2
    choice = choose(need(3), inv, running)
    assert victims(choice) == ["s1"] and choice.gpus == 2  # not big's 4
    choice = choose(need(4), inv, running)
    assert victims(choice) == ["s1", "s2"] and choice.gpus == 3  # node b whole: 3 GPUs, not big's 4
    assert choice.placement.nodes == ["b"]
    assert victims(choose(need(4), inv, [running[0]])) == ["big"]
    assert choose(need(5), inv, running) is None  # one node: none holds 5


def test_never_equal_or_higher_priority_nor_a_job_that_is_not_preemptible() -> None:
    inv = Inventory((node("a", ["eq", "eq"]), node("b", ["hi2", "hi2"]), node("c", ["keep", "keep"])))
    running = [run("eq", priority=50), run("hi2", priority=90), run("keep", preemptible=False)]
    assert choose(need(2, priority=50), inv, running) is None
    running.append(run("low", priority=0))
    inv = Inventory((*inv.nodes, node("d", ["low", "low"])))
    assert victims(choose(need(2, priority=50), inv, running)) == ["low"]


def test_youngest_first_on_ties() -> None:
    inv = Inventory((node("a", ["old", "old"]), node("b", ["young", "young"])))
    running = [run("old", started=100.0), run("young", started=200.0)]
    assert victims(choose(need(2), inv, running)) == ["young"]


def test_a_team_over_its_share_is_taken_first() -> None:
    inv = Inventory(
        (node("a", ["mine", "mine"]), node("b", ["borrowed", "borrowed", "borrowed", "borrowed"]))
    )
    running = [run("mine", team="t1", started=5), run("borrowed", team="t2", started=1)]
    assert victims(choose(need(2), inv, running)) == ["mine"]  # fewest GPUs by default
    assert victims(choose(need(2), inv, running, over_share=lambda team: team == "t2")) == ["borrowed"]


def test_several_victims_across_nodes_and_none_when_nothing_frees_enough() -> None:
    inv = Inventory((node("a", ["x", "x"]), node("b", ["y", "y"]), node("c", ["z", None])))
    running = [run("x", started=1), run("y", started=2), run("z", started=3)]
    assert victims(choose(need(4, max_nodes=2), inv, running)) == ["y", "z"]  # 3 GPUs, not x and y's 4
    assert victims(choose(need(3, max_nodes=2), inv, running)) == ["y"]  # 2 GPUs as x, and younger
    assert victims(choose(need(2, max_nodes=2), inv, running)) == ["z"]
    assert choose(need(7, max_nodes=3), inv, running) is None  # 6 devices in all


def test_the_devices_of_victims_count_as_free_though_their_worker_reports_them_busy() -> None:
    inv = Inventory((node("a", ["v", "v"]),))
    assert inv.nodes[0].free == ()
    assert freed(inv, ["v"]).nodes[0].free == (0, 1)
    assert freed(inv, []) is inv


def test_many_candidates_greedy_still_spares_what_is_not_needed() -> None:
    n = EXACT_UP_TO + 4
    inv = Inventory(tuple(node(f"n{i:02d}", [f"j{i}", f"j{i}"]) for i in range(n)))
    running = [run(f"j{i}", started=float(i)) for i in range(n)]
    choice = choose(need(4, max_nodes=2), inv, running)
    assert choice is not None and choice.gpus == 4 and len(choice.jobs) == 2
    assert victims(choice) == sorted([f"j{n - 1}", f"j{n - 2}"])  # the youngest two


def test_preemptible_follows_the_spec_then_the_operators_rule() -> None:
    assert preemptible(None, 10, 100) and not preemptible(None, 100, 100)
    assert preemptible(True, 500, 100) and not preemptible(False, 0, 100)


def test_no_set_is_searched_when_every_candidate_together_is_not_enough(monkeypatch) -> None:
    inv = Inventory(tuple(node(f"n{i}", [f"j{i}"] * 2) for i in range(EXACT_UP_TO)))
    running = [run(f"j{i}", started=float(i)) for i in range(EXACT_UP_TO)]
    tried = []
    monkeypatch.setattr(preemption, "place", lambda request, room: tried.append(room))
    assert choose(need(2 * EXACT_UP_TO + 1, max_nodes=EXACT_UP_TO), inv, running) is None
    assert len(tried) == 1  # every candidate at once: not enough, so no smaller set is tried
