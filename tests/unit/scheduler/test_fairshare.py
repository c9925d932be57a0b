"""Fair share: decayed GPU-hours, Slurm's factor over normalised shares, and what a team borrowed."""

from __future__ import annotations

import math

import pytest

from vigil_scheduler.fairshare import (
    UsageCache,
    Use,
    borrowed,
    check_share,
    decayed_gpu_hours,
    factor,
    standings,
)

H = 3600.0
NOW = 10_000 * H


def test_an_hour_now_counts_whole_and_one_a_half_life_ago_half() -> None:
    recent = decayed_gpu_hours([Use("a", 8, NOW - 60, NOW)], NOW, half_life_h=24)
    assert recent["a"] == pytest.approx(8 / 60, rel=1e-3)
    old = decayed_gpu_hours([Use("a", 8, NOW - 24 * H - 60, NOW - 24 * H)], NOW, half_life_h=24)
    assert old["a"] == pytest.approx(recent["a"] / 2, rel=1e-3)


def test_a_running_use_counts_up_to_now_and_no_further() -> None:
    hours = decayed_gpu_hours(
        [Use("a", 1, NOW - H, NOW + 5 * H), Use("b", 2, NOW + H, NOW + 2 * H)], NOW, 1e6
    )
    assert hours == {"a": pytest.approx(1.0, rel=1e-4)}


def test_the_factor_is_two_to_the_minus_usage_over_share() -> None:
    # vision has weight 3, nlp 1: shares 0.75 / 0.25; usage 50/50.
    standing = standings({"vision": 3.0}, {"vision": 10.0, "nlp": 10.0})
    assert standing["vision"].share == pytest.approx(0.75) and standing["nlp"].share == pytest.approx(0.25)
    assert standing["vision"].factor == pytest.approx(2 ** (-0.5 / 0.75))
    assert standing["nlp"].ratio == pytest.approx(2.0) and standing["nlp"].over_share
    assert not standing["vision"].over_share
    assert standing["vision"].factor > standing["nlp"].factor


def test_a_team_that_used_nothing_ranks_first_and_a_stranger_counts_as_unused() -> None:
    standing = standings({}, {"nlp": 5.0}, active=["vision", None])
    assert standing["vision"].factor == 1.0 and standing[None].usage == 0.0
    assert standing["nlp"].usage == 1.0 and standing["nlp"].share == pytest.approx(1 / 3)
    assert factor(standing, "nobody") == 1.0 and factor(standing, "nlp") == pytest.approx(2**-3)


def test_borrowed_devices_are_those_beyond_the_share_of_the_cluster() -> None:
    # 16 devices; vision (weight 1) and nlp (weight 3) both want some: 4 and 12 are theirs.
    assert borrowed({"vision": 10, "nlp": 2}, {"nlp": 3.0}, 16) == {"vision": 6}
    assert borrowed({"vision": 10}, {"nlp": 3.0}, 16) == {}  # nobody else wants any: all its own
    assert borrowed({"vision": 10}, {"nlp": 3.0}, 16, waiting=["nlp"]) == {"vision": 6}


@pytest.mark.parametrize("bad", [0, -1.5, math.inf, math.nan, True, "2"])
def test_a_share_must_be_a_finite_number_above_zero(bad: object) -> None:
    with pytest.raises(ValueError, match="share must be a number > 0"):
        check_share(bad)  # type: ignore[arg-type]
    assert check_share(2) == 2.0


def test_a_running_use_is_open_ended_and_counts_up_to_each_now() -> None:
    running = [Use("a", 2, NOW - H, math.inf)]
    assert decayed_gpu_hours(running, NOW, 1e6) == {"a": pytest.approx(2.0, rel=1e-4)}
    assert decayed_gpu_hours(running, NOW + H, 1e6) == {"a": pytest.approx(4.0, rel=1e-4)}


def test_the_usage_cache_serves_what_it_read_until_it_expires() -> None:
    cache = UsageCache(ttl_s=5.0)
    assert cache.get(NOW) is None  # nothing read yet
    uses = cache.put(NOW, [Use("a", 1, NOW - H, math.inf)])
    assert cache.get(NOW) == uses and cache.get(NOW + 4.9) == uses
    assert cache.get(NOW + 5.0) is None  # expired: the next pass reads again
    assert cache.get(NOW - 1.0) is None  # a clock behind the reading: not trusted
    fresh = cache.put(NOW + 5.0, [])
    assert cache.get(NOW + 6.0) == fresh == ()
