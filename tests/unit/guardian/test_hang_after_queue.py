"""A job that waited in the queue is not hung when it launches: "not started" counts from the launch.

The attempt is numbered at the submission (its JobStateChanged to PENDING carries it), so the
attempt's first event can be long before its launch. A hang check between the launch and the
ranks' first events once saw the whole queue time as silence and halted the job (issue 23).
"""

from tests.unit.guardian.helpers import JOB, at, launch, step
from vigil.events import JobStateChanged, RankStarted
from vigil.jobstates import JobState
from vigil_guardian.core import Guardian

TIMEOUT = 60.0


def state(to, frm, t, attempt=1):
    return JobStateChanged(
        job_id=JOB, attempt=attempt, from_state=frm, to_state=to, cause="scheduler", occurred_at=at(t)
    )


def rank_started(rank, t, attempt=1):
    return RankStarted(
        job_id=JOB, attempt=attempt, rank=rank, node=f"n{rank}", pid=1, log_path="-", occurred_at=at(t)
    )


def feed(g, events):
    out = []
    for e in events:
        out += g.on_event(e, e.occurred_at)
    return out


def queued_then_launched(launched, attempt=1):
    """Submitted at 0, placed and launched at `launched` (the scheduler's order: state, then launch)."""
    g = Guardian()
    assert feed(g, [state(JobState.PENDING, None, 0.0, attempt)]) == []
    assert g.check_hangs(at(launched - 1.0)) == []  # queued: nothing to wait for
    feed(g, [state(JobState.SCHEDULED, JobState.PENDING, launched, attempt)])
    assert g.check_hangs(at(launched + 0.001)) == []  # placed, launch not seen yet
    feed(g, [launch(2, attempt=attempt, t=launched, startup_timeout_s=TIMEOUT)])
    return g


def test_a_job_queued_past_its_hang_timeout_is_not_hung_right_after_its_launch():
    g = queued_then_launched(82.2)
    assert g.jobs[JOB].control.attempt_started_at == at(0).timestamp()  # the submission
    assert g.check_hangs(at(82.215)) == []  # 15 ms after the launch, no rank event yet
    assert g.check_hangs(at(82.2 + TIMEOUT - 1.0)) == []  # the ranks may take the timeout to start


def test_a_queued_job_whose_ranks_never_start_is_hung_the_timeout_after_its_launch():
    g = queued_then_launched(82.2)
    feed(g, [rank_started(0, 90.0)])
    out = g.check_hangs(at(82.2 + TIMEOUT + 1.0))
    assert [(d.incident.kind, d.incident.rank) for d in out] == [("hang", 1)]
    assert (
        "rank 1 on n1 has not started 61.0s after the launch (start-up limit 60.0s" in out[0].incident.message
    )
    assert out[0].incident.evidence["since"] == round(at(82.2).timestamp(), 3)


def test_a_requeued_attempt_counts_from_its_own_launch():
    """Attempt 2 waits in the queue with the world size of attempt 1 already known."""
    g = Guardian()
    feed(g, [launch(2, t=0.0, startup_timeout_s=TIMEOUT), rank_started(0, 1.0), rank_started(1, 1.0)])
    feed(g, [state(JobState.RUNNING, JobState.SCHEDULED, 1.0), step(0, 0, t=2.0), step(0, 1, t=2.0)])
    feed(g, [state(JobState.PENDING, JobState.RUNNING, 3.0, attempt=2)])  # requeued: attempt 2
    assert g.check_hangs(at(200.0)) == []  # queued
    feed(g, [state(JobState.SCHEDULED, JobState.PENDING, 300.0, attempt=2)])
    assert g.check_hangs(at(300.01)) == []  # placed, its launch not seen yet
    feed(g, [launch(2, attempt=2, t=300.0, startup_timeout_s=TIMEOUT)])
    assert g.check_hangs(at(300.02)) == []
    out = g.check_hangs(at(300.0 + TIMEOUT + 1.0))
    assert [(d.incident.kind, d.incident.rank, d.incident.attempt) for d in out] == [("hang", 0, 2)]
    assert "has not started 61.0s after the launch" in out[0].incident.message


def test_a_republished_launch_does_not_restart_the_wait():
    g = queued_then_launched(82.2)
    feed(g, [launch(2, t=120.0, startup_timeout_s=TIMEOUT)])  # same attempt, published again
    out = g.check_hangs(at(82.2 + TIMEOUT + 1.0))
    assert [d.incident.kind for d in out] == ["hang"]
