"""An attempt's start-up is its own phase (issue 39): from the launch to each rank's first step, judged
against the start-up limit, never against step times. A relaunch keeps the attempt before's step times
(`Windows.keep_times`); k x their p99 once judged every relaunch's start-up hung after the 5 s floor, so
one crash of a user program whose imports took longer ended the job FAILED."""

import pytest

from tests.unit.guardian.helpers import JOB, at, launch, step
from vigil.events import CheckpointSaved, JobStateChanged, RankStarted
from vigil.spec import CHECKPOINT_READ_BYTES_S, STARTUP_FLOOR_S, STARTUP_MULTIPLE, GuardianSpec
from vigil_guardian.core import Guardian
from vigil_guardian.hang import checkpoint_read_s, rollback_limit, startup_limit
from vigil_guardian.service import HANG_CHECK_S

QUICK = {"hang_timeout_s": 60, "hang_floor_s": 0.5, "hang_step_multiple": 10}


def feed(g, events):
    out = []
    for e in events:
        out += g.on_event(e, e.occurred_at)
    for d in out:
        g.mark_published(d.incident.event_id)
    return out


def started(rank, t, attempt=1):
    return RankStarted(
        job_id=JOB, attempt=attempt, rank=rank, node=f"n{rank}", pid=1, log_path="-", occurred_at=at(t)
    )


def running(t, attempt=1):
    return JobStateChanged(
        job_id=JOB,
        attempt=attempt,
        from_state="SCHEDULED",
        to_state="RUNNING",
        cause="ranks",
        occurred_at=at(t),
    )


def saved(s, nbytes, t):
    return CheckpointSaved(
        job_id=JOB, attempt=1, step=s, path=f"/c/step_{s:08d}", bytes=nbytes, manifest_sha256="x",
        data_position=s, occurred_at=at(t),
    )  # fmt: skip


def attempt_one(startup_s=1.0, steps=150, **guardian):
    """Attempt 1 of two ranks: launched at 0, its ranks' first steps at `startup_s`, then 0.1 s steps.
    Returns the guardian and the time of the last step."""
    g = Guardian()
    feed(g, [launch(2, **QUICK, **guardian), started(0, 0.01), started(1, 0.01), running(0.01)])
    feed(g, [saved(0, 10**6, 0.0)])  # a checkpoint to relaunch from (a hang's action is a restart)
    t = startup_s
    for k in range(steps):
        feed(g, [step(k, r, t=t) for r in range(2)])
        t += 0.1
    return g, t - 0.1


def relaunch(g, t, attempt=2, **guardian):
    """The relaunch after a crash: launched at `t`, every rank started right away, no step yet."""
    feed(g, [launch(2, attempt=attempt, t=t, **QUICK, **guardian)])
    feed(g, [started(0, t + 0.01, attempt), started(1, t + 0.01, attempt), running(t + 0.01, attempt)])


def test_a_relaunch_slower_to_start_than_k_p99_is_no_hang():
    """The regression: 0.1 s steps kept from attempt 1 gave a 1 s limit (10 x p99, floor 0.5 s); the
    relaunch's ranks, still importing 8 s later, were judged hung."""
    g, t = attempt_one()
    assert g.jobs[JOB].control.startups == [1.0]
    relaunch(g, t + 1)
    w = g.jobs[JOB].windows
    assert w.p99_step_s() == pytest.approx(0.1, abs=1e-6)  # the kept window: still there
    for silent in (8.0, 30.0, 59.0):
        assert g.check_hangs(at(t + 1.01 + silent)) == [], silent
    feed(g, [step(150, r, t=t + 1 + 20.0, attempt=2) for r in range(2)])  # first steps 20 s in
    assert g.jobs[JOB].control.startups == [1.0, 20.0]
    # past its first step, a rank is judged against the kept window again: 10 x 0.1 s, floor 0.5 s
    assert g.check_hangs(at(t + 21 + 0.9)) == []
    (d,) = g.check_hangs(at(t + 21 + 1.2))
    assert d.incident.evidence["phase"] == "step"
    assert d.incident.evidence["limit_s"] == pytest.approx(1.0, abs=1e-4)
    assert "(step limit 1.0s: 10 x the p99 step time" in d.incident.message


def test_a_rank_that_never_reaches_its_first_step_is_a_start_up_hang_at_the_limit():
    g, t = attempt_one(startup_timeout_s=600)
    relaunch(g, t + 1)
    since = t + 1.01  # the relaunch's ranks all started: the job runs again
    limit = STARTUP_FLOOR_S  # learned: 3 x 1 s, at least the floor, under the 600 s timeout
    assert g.check_hangs(at(since + limit - 0.01)) == []
    (d,) = g.check_hangs(at(since + limit + 0.01))
    inc = d.incident
    assert (inc.kind, inc.rank, inc.step, inc.action) == ("hang", 0, None, "restart")
    assert f"rank 0 on n0 never reached its first step in {limit + 0.01:.1f}s" in inc.message
    assert (
        f"(start-up limit {limit:.1f}s: 3 x this job's longest start-up, 1.0s, at least 60s)" in inc.message
    )
    assert inc.evidence["phase"] == "startup" and inc.evidence["starting"] == [0, 1]
    # the timer that calls this runs every HANG_CHECK_S: the verdict is out within the limit + 1 s
    assert HANG_CHECK_S <= 1.0


def test_a_first_attempt_that_never_steps_is_judged_by_the_start_up_timeout_not_the_step_timeout():
    g = Guardian()
    feed(g, [launch(2, **QUICK, startup_timeout_s=120), started(0, 0.01), started(1, 0.01), running(0.01)])
    assert g.check_hangs(at(100.0)) == []  # past the 60 s hang_timeout_s: no step yet is a start-up
    (d,) = g.check_hangs(at(120.02))
    assert "never reached its first step in 120.0s (start-up limit 120.0s: guardian.startup_timeout_s)" in (
        d.incident.message
    )


def test_one_rank_past_its_first_step_and_one_still_starting_are_each_judged_by_their_own_limit():
    g, t = attempt_one()
    relaunch(g, t + 1)
    t0 = t + 1.01
    t1 = t0 + 10.0
    for k in range(5):  # rank 0 makes steps (no collective in its program's first steps); rank 1 starts
        feed(g, [step(150 + k, 0, t=t1 + 0.1 * k, attempt=2)])
    assert g.check_hangs(at(t1 + 0.4 + 0.9)) == []
    (d,) = g.check_hangs(at(t1 + 0.4 + 1.1))  # rank 0 silent past its step limit
    assert (d.incident.rank, d.incident.evidence["phase"]) == (0, "step")


def test_the_learned_limit_is_k_times_the_longest_start_up_between_the_floor_and_the_timeout():
    spec = GuardianSpec(startup_timeout_s=600)
    assert startup_limit(spec, [], 0).seconds == 600  # nothing measured: the timeout
    assert startup_limit(spec, [2.0], 0).seconds == STARTUP_FLOOR_S  # 3 x 2 s: raised to the floor
    assert startup_limit(spec, [30.0, 50.0], 0).seconds == STARTUP_MULTIPLE * 50.0
    assert startup_limit(spec, [300.0], 0).seconds == 600  # 900 s: the timeout caps it
    short = GuardianSpec(startup_timeout_s=20, hang_timeout_s=10)
    assert startup_limit(short, [2.0], 0).seconds == 20  # a timeout under the floor: the floor goes too


def test_a_checkpoint_too_large_to_read_within_the_limit_raises_it():
    spec = GuardianSpec(startup_timeout_s=600)
    big = int(CHECKPOINT_READ_BYTES_S * 900)  # 180 GB: 900 s to read at the rate
    assert checkpoint_read_s(big) == pytest.approx(900)
    limit = startup_limit(spec, [2.0], big)
    assert limit.seconds == pytest.approx(900) and "180.0 GB checkpoint" in limit.why
    assert rollback_limit(spec, big).seconds == pytest.approx(900)
    assert rollback_limit(spec, 10**6).seconds == spec.hang_timeout_s


def test_the_largest_checkpoint_saved_sets_the_read_time_of_a_relaunch():
    g, t = attempt_one()
    big = int(CHECKPOINT_READ_BYTES_S * 100)
    feed(g, [saved(100, big, t)])
    relaunch(g, t + 1)
    assert g.check_hangs(at(t + 1.01 + 99.0)) == []  # the floor (60 s) would have judged it hung
    (d,) = g.check_hangs(at(t + 1.01 + 100.1))
    assert "checkpoint at 200 MB/s" in d.incident.message


def test_a_start_up_hang_that_uses_up_max_rollbacks_says_which_limit_ended_the_job():
    g = Guardian()
    feed(g, [launch(2, **QUICK, startup_timeout_s=30, max_rollbacks=0)])
    feed(g, [started(0, 0.0), started(1, 0.0), running(0.0)])
    (d,) = g.check_hangs(at(31.0))
    assert d.incident.action == "fail"
    assert "never reached its first step in 31.0s (start-up limit 30.0s: guardian.startup_timeout_s)" in (
        d.incident.message
    )
    assert d.incident.message.endswith("max_rollbacks (0) reached")


def test_a_relaunchs_first_step_is_no_imbalance_however_uneven_its_start_ups():
    """One rank loaded its checkpoint 2 s later than the other: its first step's time holds that. With
    `imbalance_steps: 1`, that first step was an imbalance incident on every relaunch."""
    g, t = attempt_one(steps=20, imbalance_steps=1)
    relaunch(g, t + 1, imbalance_steps=1)
    t0 = t + 5

    def uneven(k, t):
        return [step(k, r, t=t, attempt=2, step_time=3.0, comm=2.5 if r == 0 else 0.5) for r in range(2)]

    assert feed(g, uneven(20, t0)) == []
    assert [d.incident.kind for d in feed(g, uneven(21, t0 + 3))] == ["imbalance"]  # a second one is
