"""A hang explained: stacks grouped by call path, the outlier named with its frame (pure), and the hang
decision that waits for the dumps a bounded time."""

from __future__ import annotations

from tests.unit.guardian.helpers import JOB, at, launch, step
from vigil.events import DumpStacks, RankStacks, StackFrame, StacksDumped, ThreadStack
from vigil_guardian.core import Guardian
from vigil_guardian.stacks import explain, explained
from vigil_guardian.verdict import Verdict

LIB = "/usr/lib/python3.11"
C10D = "/venv/lib/python3.11/site-packages/torch/distributed/distributed_c10d.py"


def frame(function: str, file: str, line: int) -> StackFrame:
    return StackFrame(function=function, file=file, line=line)


IN_ALL_REDUCE = [
    frame("all_reduce", C10D, 2501),
    frame("wrapper", "/venv/lib/python3.11/site-packages/torch/distributed/c10d_logger.py", 81),
    frame("train", "/code/byo/prog.py", 40),
    frame("<module>", "/code/byo/prog.py", 60),
]
IN_LOADER = [
    frame("Condition.wait", f"{LIB}/threading.py", 327),
    frame("Event.wait", f"{LIB}/threading.py", 629),
    frame("Loader.__next__", "/code/byo/data.py", 88),
    frame("train", "/code/byo/prog.py", 37),
    frame("<module>", "/code/byo/prog.py", 60),
]
LINK = ThreadStack(name="vigil-link", frames=[frame("select", f"{LIB}/selectors.py", 468)])


def rank(r: int, frames: list[StackFrame] | None = None, error: str | None = None) -> RankStacks:
    if error is not None:
        return RankStacks(rank=r, pid=100 + r, error=error)
    return RankStacks(
        rank=r, pid=100 + r, threads=[LINK, ThreadStack(name="MainThread", frames=frames or [])]
    )


def dumped(node: str, *ranks: RankStacks, command_id: str = "c1", attempt: int = 1) -> StacksDumped:
    return StacksDumped(
        job_id=JOB, attempt=attempt, node=node, command_id=command_id, ranks=list(ranks), duration_s=0.1
    )


def test_one_rank_in_a_loader_among_ranks_waiting_in_all_reduce_is_the_outlier():
    dumps = [dumped("n0", *(rank(r, IN_ALL_REDUCE) for r in (0, 1, 2, 4, 5, 6, 7)), rank(3, IN_LOADER))]
    e = explain(dumps, range(8))
    assert e.rank == 3
    assert e.summary() == "rank 3 in `Loader.__next__` (data.py:88); 7 ranks wait in `all_reduce`"
    ev = e.evidence()
    assert ev["outlier"] == [3] and ev["missing"] == {}
    assert [g["ranks"] for g in ev["groups"]] == [[3], [0, 1, 2, 4, 5, 6, 7]]
    assert (
        ev["groups"][0]["frame"] == "Loader.__next__ (data.py:88)" and ev["groups"][0]["collective"] is None
    )
    assert ev["groups"][1]["collective"] == "all_reduce"
    assert (
        ev["groups"][0]["path"][0] == "Condition.wait (threading.py:327)"
    )  # the whole path, innermost first


def test_two_ranks_one_stuck_outside_any_collective_whichever_rank_the_detector_named():
    sleeping = [frame("stall", "/code/byo/prog.py", 21), frame("train", "/code/byo/prog.py", 35)]
    dumps = [dumped("n0", rank(0, IN_ALL_REDUCE)), dumped("n1", rank(1, sleeping))]
    for hint in (0, 1, None):
        e = explain(dumps, [0, 1], hint=hint)
        assert e.rank == 1, hint
        assert e.summary() == "rank 1 in `stall` (prog.py:21); 1 rank waits in `all_reduce`"


def test_every_rank_in_one_place_names_no_outlier_and_a_rank_without_stacks_is_said():
    dumps = [
        dumped("n0", rank(0, IN_ALL_REDUCE), rank(1, IN_ALL_REDUCE), rank(2, error="py-spy: no such process"))
    ]
    e = explain(dumps, [0, 1, 2, 3])
    assert e.outlier is None and e.rank is None
    assert e.missing == {2: "py-spy: no such process", 3: "its node sent no dump"}
    assert e.summary().startswith("all 2 ranks wait in `all_reduce`; no stacks from ranks 2, 3: ")


def test_when_every_group_waits_the_smallest_is_the_outlier():
    barrier = [frame("barrier", C10D, 4100), frame("save", "/code/byo/prog.py", 50)]
    dumps = [dumped("n0", rank(0, IN_ALL_REDUCE), rank(1, IN_ALL_REDUCE), rank(2, barrier))]
    e = explain(dumps, range(3))
    assert e.rank == 2
    assert e.summary() == "rank 2 waits in `barrier`; 2 ranks wait in `all_reduce`"


def test_the_verdict_names_the_outlier_and_keeps_the_detectors_rank():
    v = Verdict(kind="hang", message="hang: no step from rank 0 on n0 for 3.0s", rank=0, node="n0",
                evidence={"since": 1.0})  # fmt: skip
    out = explained(v, [dumped("n0", rank(0, IN_ALL_REDUCE)), dumped("n1", rank(1, IN_LOADER))], [0, 1],
                    {0: "n0", 1: "n1"})  # fmt: skip
    assert (out.rank, out.node) == (1, "n1")
    assert out.message.endswith(": rank 1 in `Loader.__next__` (data.py:88); 1 rank waits in `all_reduce`")
    assert out.evidence["silent_rank"] == 0 and out.evidence["stacks"]["outlier"] == [1]
    none = explained(v, [], [0, 1], {}, error="no dump came within 2.0s")
    assert none.rank == 0 and none.message.endswith("; no stacks: no dump came within 2.0s")
    assert none.evidence["stacks"] == {"error": "no dump came within 2.0s"}


# --- the decision waits for the dumps, a bounded time ----------------------------------------------------


def feed(g: Guardian, events: list) -> None:
    for e in events:
        assert g.on_event(e, e.occurred_at) == []


def hung() -> Guardian:
    """Two ranks on n0 and n1 at 0.1 s steps, rank 1 silent after step 5 (at 0.6 s); floor 1 s."""
    g = Guardian()
    feed(g, [launch(2, hang_timeout_s=60, hang_floor_s=1.0)])
    feed(g, [step(k, r, t=0.1 * (k + 1)) for k in range(6) for r in range(2)])
    feed(g, [step(6, 0, t=0.7)])
    return g


def test_a_hang_asks_for_stacks_once_and_is_decided_when_every_node_has_answered():
    g = hung()
    assert g.ask_stacks(at(1.0), [JOB], 2.0) == []  # no hang yet
    (ask,) = g.ask_stacks(at(2.0), [JOB], 2.0)
    assert isinstance(ask, DumpStacks) and ask.within_s == 2.0 and ask.event_id.endswith("-stacks")
    assert g.ask_stacks(at(2.5), [JOB], 2.0) == []  # once per silence
    assert g.check_hangs(at(2.5)) == []  # waiting for the dumps
    assert g.on_event(dumped("n0", rank(0, IN_ALL_REDUCE), command_id=ask.event_id), at(2.6)) == []
    assert g.on_event(dumped("n1", rank(1, IN_LOADER), command_id="another"), at(2.6)) == []  # not ours
    (d,) = g.on_event(dumped("n1", rank(1, IN_LOADER), command_id=ask.event_id), at(2.7))
    i = d.incident
    assert (i.kind, i.rank, i.node, i.action) == ("hang", 1, "n1", "halt")  # no checkpoint to go back to
    assert "rank 1 in `Loader.__next__` (data.py:88); 1 rank waits in `all_reduce`" in i.message
    assert ask.event_id == f"{i.event_id}-stacks"  # one identity for the silence, whatever the stacks say
    assert [c.type for c in d.commands] == ["job.halt"]
    g.mark_published(i.event_id)
    assert g.check_hangs(at(5.0)) == [] and g.ask_stacks(at(5.0), [JOB], 2.0) == []


def test_a_hang_is_decided_at_the_bound_without_stacks_that_do_not_come():
    g = hung()
    (ask,) = g.ask_stacks(at(2.0), [JOB], 2.0)
    g.on_event(dumped("n0", rank(0, IN_ALL_REDUCE), command_id=ask.event_id), at(2.2))
    assert g.check_hangs(at(3.9)) == []
    (d,) = g.check_hangs(at(4.0))  # the bound: the action goes out with what came
    assert d.incident.rank == 1  # no outlier without rank 1's stacks: the rank the detector named
    assert "no stacks from rank 1: its node sent no dump" in d.incident.message
    silent = hung()
    silent.ask_stacks(at(2.0), [JOB], 2.0)
    (d,) = silent.check_hangs(at(4.0))
    assert d.incident.message.endswith("; no stacks: no dump came within 2.0s")


def test_a_failed_ask_decides_at_once_and_a_step_ends_the_wait():
    g = hung()
    g.ask_stacks(at(2.0), [JOB], 2.0)
    g.jobs[JOB].stacks_not_asked("NATS is away", at(2.1))
    (d,) = g.check_hangs(at(2.1))
    assert "no stacks: the dump was not asked for: NATS is away" in d.incident.message
    g2 = hung()
    (first,) = g2.ask_stacks(at(2.0), [JOB], 2.0)
    feed(g2, [step(6, 1, t=2.1), step(7, 0, t=2.1), step(7, 1, t=2.1)])  # rank 1 was only slow
    assert g2.check_hangs(at(2.2)) == []  # no hang now, no incident
    (again,) = g2.ask_stacks(at(30.0), [JOB], 2.0)  # a later silence is asked about anew
    assert again.event_id != first.event_id


def test_a_ddp_rank_waiting_in_backward_waits_and_the_rank_outside_is_the_outlier():
    autograd = "/venv/lib/python3.11/site-packages/torch/autograd/graph.py"
    in_backward = [
        frame("_engine_run_backward", autograd, 768),
        frame("backward", "/venv/lib/python3.11/site-packages/torch/_tensor.py", 581),
        frame("train", "/code/byo/prog.py", 44),
    ]
    dumps = [dumped("n0", rank(0, in_backward), rank(1, IN_LOADER))]
    for hint in (0, 1):
        e = explain(dumps, [0, 1], hint=hint)
        assert e.rank == 1
        assert (
            e.summary() == "rank 1 in `Loader.__next__` (data.py:88); 1 rank waits in `_engine_run_backward`"
        )


def test_a_nodes_dump_speaks_only_for_the_ranks_placed_on_it():
    forged = dumped("n0", rank(0, IN_ALL_REDUCE), rank(1, IN_ALL_REDUCE))  # n0 claims n1's rank 1 too
    e = explain([forged, dumped("n1", rank(1, IN_LOADER))], [0, 1], nodes={0: "n0", 1: "n1"})
    assert e.rank == 1 and e.summary().startswith("rank 1 in `Loader.__next__`")
    alone = explain([forged], [0, 1], nodes={0: "n0", 1: "n1"})
    assert alone.missing == {1: "its node sent no dump"}


def test_many_places_keep_the_message_short_and_the_evidence_bounded():
    spinning = [rank(r, [frame("spin", "/code/byo/prog.py", 100 + r)]) for r in range(40)]
    e = explain([dumped("n0", *spinning)], range(40))
    assert e.summary().endswith("; 36 more ranks in 36 other places") and e.summary().count(";") == 4
    assert len(e.evidence()["groups"]) == 16 and e.evidence()["more_groups"] == 24
