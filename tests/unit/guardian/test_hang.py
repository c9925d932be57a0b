import pytest

from tests.unit.guardian.helpers import JOB, at, launch, step
from vigil.spec import GuardianSpec
from vigil_guardian.core import Guardian
from vigil_guardian.hang import hang, hang_limit, p99
from vigil_guardian.windows import Windows

LIMITS = {"timeout_s": 60, "multiple": 10, "floor_s": 1.0}


def test_p99_is_the_nearest_rank_percentile_and_the_largest_under_100_samples():
    assert p99([]) is None
    assert p99([0.3]) == 0.3
    assert p99([0.1] * 98 + [2.0]) == 2.0  # 99 samples: a rare save is not yet rare enough to drop
    assert p99([0.1] * 199 + [2.0]) == 0.1  # 200 samples: the single slowest is the 0.5 %
    assert p99([0.1] * 197 + [2.0] * 3) == 2.0  # three in 200 is 1.5 %: inside the p99


def test_limit_is_k_times_p99_between_the_floor_and_the_timeout():
    assert hang_limit(None, **LIMITS) == 60  # no step time yet: the timeout alone
    assert hang_limit(0.5, **LIMITS) == 5.0  # 10 x 0.5 s
    assert hang_limit(10.0, **LIMITS) == 60  # 100 s, capped by the timeout
    assert hang_limit(0.01, **LIMITS) == 1.0  # 0.1 s, raised to the floor
    # a 0.1 s step is judged at 1 s on a 1 s floor, not on the old 5 s
    assert hang_limit(0.1, timeout_s=60, multiple=10, floor_s=0.5) == pytest.approx(1.0)


def test_names_the_rank_silent_longest():
    progress = {0: (100.0, 9), 1: (90.0, 8), 2: (100.0, 9)}
    v = hang(125.0, progress, 10.0, nodes={1: "n1"})
    assert v is not None
    assert (v.kind, v.rank, v.node, v.step) == ("hang", 1, "n1", 9)
    assert v.evidence["silent_s"] == pytest.approx(35.0)
    assert v.evidence["limit_s"] == 10
    assert hang(99.0, progress, 10.0, nodes={}) is None


def test_no_step_yet_is_judged_against_the_limit_given():
    progress = {0: (0.0, None), 1: (0.0, None)}
    assert hang(59.0, progress, 60.0, nodes={}) is None
    v = hang(61.0, progress, 60.0, nodes={})
    assert v is not None and v.step is None and v.rank == 0


def _steps(windows: Windows, times: list[float], rank: int = 0) -> None:
    for k, t in enumerate(times):
        windows.observe(step(k, rank, t=t, step_time=0.05), None, {})


def test_a_step_time_is_the_wall_time_between_a_ranks_steps_so_a_save_counts():
    w = Windows(GuardianSpec(hang_window=10))
    # steps 0.1 s apart, and a 1.5 s checkpoint save between steps 4 and 5
    times = [0.1 * k for k in range(5)] + [0.4 + 1.5 + 0.1 * k for k in range(1, 6)]
    _steps(w, times)
    assert w.p99_step_s() == pytest.approx(1.6)  # the save is in the window: 10 x 1.6 s, not 10 x 0.1 s
    assert len(w.step_times) == 9  # 9 intervals: a rank's first step (its warm-up) gives no time
    _steps(w, [times[-1] + 0.1 * k for k in range(1, 12)], rank=1)  # another rank, 0.1 s apart
    assert w.p99_step_s() == pytest.approx(0.1, abs=1e-5)  # the window (10 steps) has moved past the save


def test_a_fast_job_is_judged_within_k_p99_or_its_floor_plus_the_check_period():
    """The detection target, as pure logic: a job of 0.1 s steps with k = 10 and a floor of 0.5 s is
    hung 1 s after its last step, and a check every 0.5 s finds it by 1.5 s (it once took 5 s)."""
    g = Guardian()
    g.on_event(launch(2, hang_timeout_s=60, hang_floor_s=0.5, hang_step_multiple=10), at(0))
    for k in range(30):
        for r in range(2):
            g.on_event(step(k, r, t=0.1 * (k + 1)), at(0.1 * (k + 1)))
    last = 3.0
    g.on_event(step(30, 0, t=last + 0.1), at(last + 0.1))  # rank 1 goes silent after step 29
    assert g.check_hangs(at(last + 0.99)) == []
    found = [t for t in (last + 0.5 * i for i in range(1, 10)) if g.check_hangs(at(t))]
    assert found and found[0] - last <= max(10 * 0.1, 0.5) + 0.5
    assert g.jobs[JOB].windows.p99_step_s() == pytest.approx(0.1, abs=1e-5)


def test_a_slow_job_is_not_judged_before_k_p99():
    g = Guardian()
    g.on_event(launch(1, hang_timeout_s=600, hang_floor_s=0.5, hang_step_multiple=10), at(0))
    for k in range(10):
        g.on_event(step(k, 0, t=2.0 * (k + 1)), at(2.0 * (k + 1)))
    assert g.check_hangs(at(20.0 + 19.9)) == []  # 10 x 2 s = 20 s
    (d,) = g.check_hangs(at(20.0 + 20.1))
    assert d.incident.evidence["limit_s"] == pytest.approx(20.0)


def test_a_step_out_of_order_or_with_a_gap_adds_no_step_time():
    w = Windows(GuardianSpec())
    w.observe(step(0, 0, t=1.0, step_time=0.2), None, {})  # a first step: its warm-up is no step time
    w.observe(step(2, 0, t=9.0), None, {})  # step 1 never came (a rollback, a replay): no interval
    w.observe(step(3, 0, t=9.3), None, {})
    assert list(w.step_times) == [pytest.approx(0.3)]
    w.observe(step(4, 0, t=9.3), None, {})  # stamped at the same time as the last: no interval either
    assert len(w.step_times) == 1


def test_a_step_has_one_time_the_slowest_ranks_so_the_window_counts_steps_at_any_world_size():
    w = Windows(GuardianSpec(hang_window=10))
    for k in range(6):
        for r in range(64):
            slow = 0.5 if (r == 7 and k == 3) else 0.0
            w.observe(step(k, r, t=k * 0.1 + slow + 0.001 * r), None, {})
    assert len(w.step_times) == 5  # steps 1..5, one time each for 64 ranks
    assert w.p99_step_s() == pytest.approx(0.6, abs=1e-3)  # step 3: rank 7's 0.5 s more


def test_a_save_gap_has_its_own_window_and_a_held_step_none():
    w = Windows(GuardianSpec(hang_window=20))
    w.checkpoint_every = 5  # the checkpoint of step 5 is written between steps 4 and 5
    w.held.append(7)  # step 7 was held and replayed
    times = [0.1 * k for k in range(5)] + [0.4 + 1.5 + 0.1 * k for k in range(1, 3)]  # steps 0-6
    times += [times[-1] + 0.3, times[-1] + 0.4]  # step 7 took three steps' time (held), step 8 one
    _steps(w, times)
    assert w.p99_step_s() == pytest.approx(0.1, abs=1e-5)  # neither the save nor the held step
    assert list(w.save_times) == [pytest.approx(1.6)]
    assert w.p99_wait_s() == pytest.approx(0.1, abs=1e-5)  # rank 0's next step (9) follows no save
    _steps(w, [times[-1] + 0.1])  # step 0 again on rank 0: (a new rank-0 history) no gap
    w.progress[0] = (10.0, 9)  # the next step, 10, comes after the checkpoint of 10
    assert w.p99_wait_s() == pytest.approx(1.6)


def _saving_job(last_step: int) -> tuple[Guardian, float]:
    """One rank, 0.1 s steps and a 1.5 s save before every 5th step, up to `last_step`."""
    g = Guardian()
    g.on_event(
        launch(1, hang_timeout_s=60, hang_floor_s=0.5, hang_step_multiple=10, checkpoint_every=5), at(0)
    )
    t = 0.0
    for k in range(last_step + 1):
        t += 1.6 if k > 0 and k % 5 == 0 else 0.1
        g.on_event(step(k, 0, t=t), at(t))
    return g, t


def test_a_save_is_judged_against_the_saves_and_a_step_against_the_steps():
    """A 3 s silence before a save is no hang (10 x 1.6 s); the same silence before any other step is one
    (10 x 0.1 s): the saves no longer stretch every step's limit to 16 s."""
    g, t = _saving_job(11)  # the next step, 12, follows no save
    assert g.jobs[JOB].windows.p99_step_s() == pytest.approx(0.1, abs=1e-5)
    (d,) = g.check_hangs(at(t + 3.0))
    assert d.incident.evidence["limit_s"] == pytest.approx(1.0, abs=1e-4)
    g, t = _saving_job(14)  # the next step, 15, comes after the checkpoint of 15
    assert g.check_hangs(at(t + 3.0)) == []
    (d,) = g.check_hangs(at(t + 16.5))
    assert d.incident.evidence["limit_s"] == pytest.approx(16.0, abs=1e-3)


def test_a_relaunch_on_as_many_ranks_keeps_the_step_window_and_on_another_number_forgets_it():
    """The relaunched attempt's first steps are slow (a fresh process); judged on a window of its own,
    its p99 was the slowest of them for its first 100 steps. The attempt before's steps stay in it."""

    def relaunched(world: int) -> Guardian:
        g = Guardian()
        g.on_event(launch(1, hang_timeout_s=60, hang_floor_s=0.5, hang_step_multiple=10), at(0))
        t = 0.0
        for k in range(150):  # attempt 1: 0.1 s steps
            t += 0.1
            g.on_event(step(k, 0, t=t), at(t))
        g.on_event(launch(world, attempt=2, t=t + 1, hang_timeout_s=60, hang_floor_s=0.5), at(t + 1))
        for k, dt in enumerate([2.0, 0.4, 0.1, 0.1]):  # from step 140: the relaunch's slow second step
            t += dt
            g.on_event(step(140 + k, 0, t=t, attempt=2), at(t))
        return g

    w = relaunched(world=1).jobs[JOB].windows
    assert len(w.step_times) == 100 and w.p99_step_s() == pytest.approx(0.1, abs=1e-5)
    w = relaunched(world=2).jobs[JOB].windows  # another size: its own times only (3 steps' gaps)
    assert len(w.step_times) == 3 and w.p99_step_s() == pytest.approx(0.4)
