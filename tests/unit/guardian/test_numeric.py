import math

import pytest

from tests.unit.guardian.helpers import step
from vigil import spike_rule
from vigil_guardian import windows


@pytest.mark.parametrize(
    ("kw", "found"),
    [
        ({"loss": 2.0}, False),
        ({"loss": math.nan}, True),
        ({"loss": math.inf}, True),
        ({"loss": 2.0, "grad_norm": math.inf}, True),
        ({"loss": 2.0, "grad_norm": None}, False),
        ({"loss": 2.0, "skipped": True}, True),
    ],
)
def test_non_finite(kw, found):
    v = windows.non_finite(step(7, rank=1, **kw))
    assert (v is not None) == found
    if v:
        assert (v.kind, v.step, v.rank, v.node) == ("nan", 7, 1, "n1")


def test_nan_evidence_is_json_safe():
    v = windows.non_finite(step(3, loss=math.nan, grad_norm=-math.inf))
    assert v.evidence["loss"] == "NaN" and v.evidence["grad_norm"] == "-Infinity"


def test_robust_z_known_answer():
    # median 2.0, absolute deviations [0.1, 0, 0.1, 0.2, 0.2] -> MAD 0.1 -> scale 0.14826
    z, median, mad = spike_rule.robust_z([1.9, 2.0, 2.1, 1.8, 2.2], 2.0 + 0.14826 * 7)
    assert median == 2.0 and mad == pytest.approx(0.1)
    assert z == pytest.approx(7.0)


def spike_at(history, loss, **kw):
    args = {"zscore": 6.0, "warmup": 5, "step": len(history), "rank": 0, "node": "n0", **kw}
    return windows.spike(history, loss, **args)


def test_spike_after_warmup_only():
    noisy = [2.0 + 0.05 * ((i * 7) % 5 - 2) for i in range(20)]
    assert spike_at(noisy, 2.1) is None
    v = spike_at(noisy, 20.0)
    assert v is not None and v.kind == "spike" and v.evidence["zscore"] > 6
    assert spike_at(noisy[:4], 20.0) is None  # still warming up


def test_spike_threshold_is_the_specs():
    noisy = [2.0 + 0.05 * ((i * 7) % 5 - 2) for i in range(20)]  # MAD 0.05 -> scale ~0.074
    assert spike_at(noisy, 2.5, zscore=6.0) is not None  # z ~ 6.7
    assert spike_at(noisy, 2.5, zscore=8.0) is None


def test_flat_series_needs_a_real_jump():
    flat = [2.0] * 20  # MAD 0: the relative floor (2 % of the median) decides
    assert spike_at(flat, 2.2) is None  # z = 5
    assert spike_at(flat, 2.3) is not None  # z = 7.5


def test_falling_loss_is_never_a_spike():
    falling = [5.0 - 0.1 * i for i in range(30)]
    assert spike_at(falling, 2.0) is None


def diverge(losses, **kw):
    args = {"window": 20, "tolerance": 0.5, "step": len(losses) - 1, "rank": 0, "node": "n0", **kw}
    return windows.divergence(losses, **args)


def test_divergence_on_a_rising_loss():
    losses = [2.0] * 20 + [2.0 + 0.1 * i for i in range(1, 15)]  # smoothed rises to ~3.1
    v = diverge(losses)
    assert v is not None and v.kind == "divergence" and v.evidence["rise"] > 0.5


def test_no_divergence_within_tolerance_or_when_falling():
    assert diverge([2.0] * 20 + [2.5] * 10) is None  # +25 %
    assert diverge([5.0 - 0.05 * i for i in range(60)]) is None
    assert diverge([2.0] * 10) is None  # fewer than a window of values


def test_a_single_spike_is_not_divergence():
    losses = [2.0] * 30 + [100.0] + [2.0] * 3
    assert diverge(losses) is None
    assert diverge([2.0] * 30 + [100.0]) is None
