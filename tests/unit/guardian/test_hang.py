import pytest

from vigil_guardian.hang import MIN_HANG_S, hang, hang_limit


def test_limit_is_timeout_or_multiple_of_median_whichever_is_sooner():
    assert hang_limit(None, timeout_s=60, multiple=20) == 60
    assert hang_limit(1.0, timeout_s=60, multiple=20) == 20
    assert hang_limit(10.0, timeout_s=60, multiple=20) == 60
    assert hang_limit(0.01, timeout_s=60, multiple=20) == MIN_HANG_S


def test_names_the_rank_silent_longest():
    progress = {0: (100.0, 9), 1: (90.0, 8), 2: (100.0, 9)}
    v = hang(125.0, progress, 1.0, timeout_s=60, multiple=20, nodes={1: "n1"})
    assert v is not None
    assert (v.kind, v.rank, v.node, v.step) == ("hang", 1, "n1", 9)
    assert v.evidence["silent_s"] == pytest.approx(35.0)
    assert hang(105.0, progress, 1.0, timeout_s=60, multiple=20, nodes={}) is None


def test_no_step_yet_uses_the_timeout():
    progress = {0: (0.0, None), 1: (0.0, None)}
    assert hang(59.0, progress, None, timeout_s=60, multiple=20, nodes={}) is None
    v = hang(61.0, progress, None, timeout_s=60, multiple=20, nodes={})
    assert v is not None and v.step is None and v.rank == 0
