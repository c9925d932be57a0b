"""The placement loop's pacing: a pass asked for right after another waits a gap that follows the last
pass's cost, bounded; one asked for after a quiet spell runs at once."""

from __future__ import annotations

import pytest

from vigil_scheduler.pacing import Pacing

PACING = Pacing(min_gap_s=0.05, max_gap_s=0.25, ratio=2.0)


def test_an_ask_after_a_quiet_spell_runs_at_once() -> None:
    assert PACING.delay(now=100.0, started=10.0, ended=10.02) == 0.0


def test_an_ask_right_after_a_cheap_pass_waits_the_least_gap() -> None:
    # a 10 ms pass: twice its cost is under the least gap, which wins
    assert PACING.delay(now=10.01, started=9.99, ended=10.0) == pytest.approx(0.04)


def test_the_gap_follows_the_last_pass_cost() -> None:
    # a 100 ms pass: the next waits 200 ms after its end, less what passed since
    assert PACING.delay(now=10.05, started=9.9, ended=10.0) == pytest.approx(0.15)


def test_no_placement_waits_more_than_the_bound_however_slow_the_pass() -> None:
    assert PACING.delay(now=12.0, started=10.0, ended=12.0) == pytest.approx(0.25)
    assert PACING.gap(took_s=30.0) == 0.25
