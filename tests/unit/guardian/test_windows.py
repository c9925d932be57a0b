"""The detectors that judge a whole step: who made a NaN, gradient-norm spikes, divergence of the
cross-rank loss, and a persistent straggler scored over a window."""

import math
import random

from tests.unit.guardian.helpers import step
from vigil import spike_rule
from vigil.spec import GuardianSpec
from vigil_guardian import windows
from vigil_guardian.collective import StragglerScores
from vigil_guardian.windows import Windows

NODES = {r: f"n{r}" for r in range(4)}


def observe_all(w, events, world=4):
    out = []
    for e in events:
        out += w.observe(e, world, NODES)
    return out


def test_a_nan_is_named_after_the_rank_whose_own_loss_was_not_finite_whoever_reports_first():
    w = Windows(GuardianSpec())
    observe_all(w, [step(k, r, 2.0) for k in range(5) for r in range(4)])
    # after the all-reduce every rank's grad norm is NaN and every rank skips the update
    witnesses = [step(5, r, 2.0, grad_norm=math.nan, skipped=True) for r in (0, 2, 3)]
    assert observe_all(w, witnesses) == []  # held: none of them made it
    (v,) = observe_all(w, [step(5, 1, math.nan, grad_norm=math.nan, skipped=True)])
    assert (v.kind, v.rank, v.node, v.step) == ("nan", 1, "n1", 5)


def test_an_overflow_no_rank_owns_is_named_once_the_step_is_complete():
    w = Windows(GuardianSpec())
    out = observe_all(w, [step(0, r, 2.0, grad_norm=math.inf, skipped=True) for r in range(4)])
    assert [(v.kind, v.rank) for v in out] == [("nan", 0)]
    assert out[0].evidence["culprit"].startswith("unknown")


def test_a_v1_sender_or_a_single_rank_is_judged_from_its_own_event():
    w = Windows(GuardianSpec())
    v1 = step(0, 2, 2.0, grad_norm=math.nan, skipped=True, local_finite=None)
    assert [(v.kind, v.rank) for v in w.observe(v1, 4, NODES)] == [("nan", 2)]
    alone = Windows(GuardianSpec())
    out = alone.observe(step(0, 0, 2.0, grad_norm=math.nan, skipped=True), 1, NODES)
    assert [(v.kind, v.rank) for v in out] == [("nan", 0)]


def test_a_gradient_norm_explosion_is_a_spike_and_benign_bumps_are_not():
    rng = random.Random(0)
    w = Windows(GuardianSpec())
    out = []
    for k in range(60):
        g = 1.5 * math.exp(rng.gauss(0, 0.15)) * (3.0 if k % 17 == 16 else 1.0)  # 3x bumps: benign
        out += observe_all(w, [step(k, r, 2.0 + 0.01 * rng.gauss(0, 1), grad_norm=g) for r in range(4)])
    assert out == []
    (v,) = observe_all(w, [step(60, r, 2.0, grad_norm=40.0) for r in range(4)])
    assert (v.kind, v.step, v.rank) == ("spike", 60, None) and v.evidence["ratio"] > 8


def test_a_slow_divergence_is_caught_by_the_trend_and_a_data_mix_shift_is_not():
    rng = random.Random(1)

    def losses(n, rate=0.0, shift_at=None):
        out, x = [], 3.0
        for k in range(n):
            x *= 1 + rate
            y = x * (1.04 if shift_at is not None and shift_at <= k < shift_at + 100 else 1.0)
            out.append(y * (1 + 0.015 * rng.gauss(0, 1)))  # the cross-rank median of 4 ranks at 3 %
        return out

    args = {"window": 50, "tolerance": 0.1, "step": 0}
    shifted = losses(300, shift_at=120)
    assert all(windows.divergence(shifted[: k + 1], **args) is None for k in range(300))
    slow = losses(100) + losses(200, rate=0.002)
    found = next(k for k in range(300) if windows.divergence(slow[: k + 1], **args))
    assert 100 < found < 250
    assert windows.divergence([*losses(60), 100.0], **args) is None  # one spike is not a trend


def test_trend_slope_and_error():
    slope, se = windows.trend([1.0, 2.0, 3.0, 4.0])
    assert math.isclose(slope, 1.0) and se < 1e-6


def test_a_spike_must_be_sudden_a_climb_is_left_to_divergence():
    rng = random.Random(5)
    flat = [2.0 * (1 + 0.03 * rng.gauss(0, 1)) for _ in range(30)]  # 3 % per-rank noise
    history = flat + [2.0 * 1.03**k for k in range(1, 11)]  # then a climb of 3 % a step
    climb = 2.0 * 1.03**11
    args = {"zscore": 6.0, "warmup": 5, "step": 40, "rank": 0, "node": "n0"}
    assert spike_rule.robust_z(history, climb)[0] > 6  # far above the window's median, yet
    assert windows.spike(history, climb, **args) is None  # no jump from the last few steps
    assert windows.spike(history, 2 * climb, **args) is not None


def test_a_short_window_borrows_its_peers_spread():
    rng = random.Random(7)
    history = [2.0 * (1 + 0.002 * rng.gauss(0, 1)) for _ in range(10)]  # a lucky, too-quiet window
    args = {"zscore": 6.0, "warmup": 5, "step": 10, "rank": 0, "node": "n0"}
    assert windows.spike(history, 2.3, **args) is not None
    assert windows.spike(history, 2.3, peer_spread=0.06, **args) is None


def test_a_persistent_15_percent_straggler_is_scored_over_a_window():
    rng = random.Random(3)
    scores = StragglerScores()
    out = []
    for k in range(40):
        compute = [
            0.3 * (1 + 0.03 * rng.gauss(0, 1)) * (1.15 if r == 3 and k >= 10 else 1.0) for r in range(4)
        ]
        compute[1] *= 3.0 if k == 5 else 1.0  # a single slow step is no straggler
        top = max(compute)
        events = [step(k, r, step_time=top + 0.05, comm=top - compute[r] + 0.05) for r in range(4)]
        out.append(scores.observe(events, NODES))
    found = [(k, v) for k, v in enumerate(out) if v is not None]
    assert len(found) == 1
    k, v = found[0]
    assert (v.kind, v.rank, v.node) == ("imbalance", 3, "n3") and 15 <= k <= 30
    assert v.evidence["score"] > 1.1
