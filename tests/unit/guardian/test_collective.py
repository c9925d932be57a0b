from tests.unit.guardian.helpers import step
from vigil_guardian.collective import ImbalanceTracker, spread

NODES = {0: "n0", 1: "n1", 2: "n2"}


def balanced(k):
    return [step(k, r, step_time=1.0, comm=0.1, t=k) for r in range(3)]


def slow(k, who=2, extra=0.5):
    # the slow rank computes longer and waits least; the others wait for it in the collective
    return [step(k, r, step_time=1.0 + extra, comm=0.1 if r == who else 0.1 + extra, t=k) for r in range(3)]


def test_spread_names_the_slow_rank():
    s = spread(slow(4))
    assert s.straggler == 2
    assert s.ratio > 0.3


def test_imbalance_after_n_consecutive_steps_names_rank_and_node():
    tr = ImbalanceTracker(0.2, 5)
    out = [tr.observe(slow(k), NODES) for k in range(5)]
    assert out[:4] == [None] * 4
    v = out[4]
    assert (v.kind, v.rank, v.node, v.step) == ("imbalance", 2, "n2", 4)
    assert len(v.evidence["ratios"]) == 5
    # the episode goes on: no second incident
    assert all(tr.observe(slow(k), NODES) is None for k in range(5, 20))


def test_a_balanced_step_breaks_the_run():
    tr = ImbalanceTracker(0.2, 3)
    assert tr.observe(slow(0), NODES) is None
    assert tr.observe(slow(1), NODES) is None
    assert tr.observe(balanced(2), NODES) is None
    assert tr.observe(slow(3), NODES) is None
    assert tr.observe(slow(4), NODES) is None
    assert tr.observe(slow(5), NODES) is not None
    # clears, then a new episode is a new incident
    assert tr.observe(balanced(6), NODES) is None
    assert [tr.observe(slow(k, who=0), NODES) for k in (7, 8, 9)][-1].rank == 0


def test_below_threshold_is_quiet():
    tr = ImbalanceTracker(0.2, 2)
    assert all(tr.observe(slow(k, extra=0.1), NODES) is None for k in range(10))


def test_late_arrival_is_a_straggler():
    tr = ImbalanceTracker(0.2, 3)
    out = None
    for k in range(3):
        events = [step(k, r, step_time=1.0, comm=0.1, t=k + (0.5 if r == 1 else 0.0)) for r in range(3)]
        out = tr.observe(events, NODES)
    assert out is not None and (out.kind, out.rank, out.node) == ("straggler", 1, "n1")


def test_single_rank_has_no_imbalance():
    assert ImbalanceTracker(0.2, 1).observe([step(0)], NODES) is None


def test_jitter_on_very_short_steps_is_not_an_imbalance():
    # 15 ms of jitter is 30 % of a 50 ms CPU step, but no rank is a straggler
    tr = ImbalanceTracker(0.2, 3)
    jitter = [
        [step(k, r, step_time=0.05, comm=0.005 if r == k % 3 else 0.02, t=k) for r in range(3)]
        for k in range(10)
    ]
    assert all(tr.observe(steps, NODES) is None for steps in jitter)
    assert spread(jitter[0]).ratio == 0.0
    # the same share of a step from a real slow rank (0.3 s) still counts
    assert spread(slow(0, extra=0.3)).ratio > 0.2
