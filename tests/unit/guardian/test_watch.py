"""The guardian's decisions on synthetic event streams whose answers are known."""

import math

from tests.unit.guardian.helpers import JOB, at, gpu, launch, step
from vigil.events import (
    CheckpointSaved,
    JobStateChanged,
    RankExited,
    RankStarted,
    RankValue,
    RollbackCompleted,
    StepReplayed,
)
from vigil_guardian.core import Guardian
from vigil_guardian.service import outgoing
from vigil_guardian.state import Control
from vigil_guardian.watch import JobWatch


def ckpt(s, t=0.0):
    return CheckpointSaved(
        job_id=JOB,
        attempt=1,
        step=s,
        path=f"/c/step_{s:08d}",
        bytes=1,
        manifest_sha256="x",
        data_position=s,
        occurred_at=at(t),
    )


def rc(to, frm, t, checkpoint=None):
    return RollbackCompleted(
        job_id=JOB,
        attempt=1,
        from_step=frm,
        to_step=to,
        checkpoint=checkpoint or f"/c/step_{to:08d}",
        command_id="c",
        duration_s=0.1,
        node="n0",
        occurred_at=at(t),
    )


def feed(g, events, now=None):
    out = []
    for e in events:
        out += g.on_event(e, now or e.occurred_at)
    for d in out:
        g.mark_published(d.incident.event_id)
    return out


def noisy(k):
    return 3.0 - 0.01 * k + 0.02 * ((k * 7) % 5 - 2)


def normal_steps(first, last, world=2, t0=0.0):
    return [step(k, r, noisy(k), t=t0 + 0.1 * (k - first)) for k in range(first, last) for r in range(world)]


def started(world=2, **guardian):
    g = Guardian()
    feed(g, [launch(world, **guardian), ckpt(0), ckpt(5, 0.55)])
    return g


def test_nan_on_one_rank_rolls_back_once_to_the_newest_checkpoint_at_or_before_it():
    g = started()
    assert feed(g, normal_steps(0, 7)) == []
    out = feed(g, [step(7, 0, math.nan, t=0.70, skipped=True)], now=at(0.705))
    assert len(out) == 1
    d = out[0]
    assert (d.incident.kind, d.incident.action, d.incident.step, d.incident.rank) == ("nan", "rollback", 7, 0)
    assert [c.type for c in d.commands] == ["job.halt", "job.rollback"]
    assert d.commands[1].checkpoint == "/c/step_00000005" and d.commands[1].step == 5
    # the same fault seen on the other rank, and steps in flight, are not new incidents
    assert feed(g, [step(7, 1, math.nan, t=0.70, skipped=True)]) == []
    assert feed(g, [step(8, 0, math.nan, t=0.80, skipped=True), step(8, 1, math.nan, t=0.80)]) == []
    # the rollback completes; the re-run of steps 5.. is a new timeline, not a new fault
    assert feed(g, [rc(5, 8, 1.0)]) == []
    assert feed(g, [step(k, r, noisy(k), t=1.0 + 0.1 * (k - 4)) for k in range(5, 15) for r in (0, 1)]) == []
    # a late event of the abandoned timeline is dropped
    assert feed(g, [step(9, 1, math.nan, t=0.90)]) == []
    assert g.jobs[JOB].control.rollbacks == 1 and g.jobs[JOB].control.generation == 1


def test_a_fault_that_comes_back_after_every_rollback_ends_in_fail():
    g = started(max_rollbacks=1)
    feed(g, normal_steps(0, 7))
    first = feed(g, [step(7, 0, math.nan, t=0.7)], now=at(0.71))
    assert first[0].action == "rollback"
    feed(g, [rc(5, 7, 1.0)])
    feed(g, [step(k, r, noisy(k), t=1.0 + 0.1 * (k - 4)) for k in (5, 6) for r in (0, 1)])
    again = feed(g, [step(7, 0, math.nan, t=1.35)], now=at(1.36))
    assert len(again) == 1 and again[0].action == "fail"
    assert [m.type for _, m in outgoing(again[0])] == ["incident.raised"]  # the scheduler cancels
    # the job is over: nothing more from it
    assert feed(g, [step(8, 0, math.nan, t=1.45)]) == []
    feed(g, [JobStateChanged(job_id=JOB, attempt=1, from_state="RUNNING", to_state="FAILED", cause="x")])
    assert JOB not in g.jobs


def test_spike_rolls_back_with_the_data_window_skipped():
    g = started(spike_skip_steps=2, spike_warmup=10)
    assert feed(g, normal_steps(0, 20)) == []
    out = feed(g, [step(20, 1, noisy(20) * 50, t=2.0, data_position=20)], now=at(2.01))
    assert len(out) == 1
    d = out[0]
    assert (d.incident.kind, d.incident.rank, d.incident.step) == ("spike", 1, 20)
    rollback = d.commands[1]
    assert rollback.skip_data == (20, 22) and rollback.step == 5


def test_slow_rank_gives_one_imbalance_incident_naming_it():
    g = started(world=3, imbalance_steps=4)
    out = []
    for k in range(12):
        out += feed(
            g,
            [step(k, r, noisy(k), t=0.5 * k, step_time=0.4, comm=0.02 if r == 2 else 0.22) for r in range(3)],
        )
    assert len(out) == 1
    inc = out[0].incident
    # steps 1-4: a rank's first step times its start-up, not its speed (issue 39), so step 0 is not judged
    assert (inc.kind, inc.rank, inc.node, inc.action, inc.step) == ("imbalance", 2, "n2", "alert", 4)


def test_steps_judged_before_the_launch_is_known_still_count_toward_an_imbalance():
    """The launch and the steps come by different consumers: the first steps may be judged before
    the guardian knows the world size. They are held, and judged in order once it is known."""
    g = Guardian()
    slow = [
        [step(k, r, noisy(k), t=0.5 * k, step_time=0.4, comm=0.02 if r == 2 else 0.22) for r in range(3)]
        for k in range(4)
    ]
    out = feed(g, slow[0] + slow[1] + slow[2][:2])  # no launch yet: no world size
    assert out == []
    out = feed(g, [launch(3, imbalance_steps=3)] + slow[2][2:] + slow[3])
    assert [(d.incident.kind, d.incident.rank, d.incident.step) for d in out] == [("imbalance", 2, 3)]
    assert out[0].incident.evidence["steps"] == [1, 2, 3]  # step 0, the ranks' first, times their start-up


def test_missing_steps_give_a_hang_then_the_policys_action():
    g = started(hang_timeout_s=10)
    feed(g, normal_steps(0, 6))
    feed(g, [step(6, 0, noisy(6), t=0.6)])  # rank 1 goes silent after step 5
    assert g.check_hangs(at(5.2)) == []  # 10 x p99 (0.1 s) would be 1 s, but the default floor is 5 s
    out = g.check_hangs(at(10.6))
    assert len(out) == 1
    d = out[0]
    assert (d.incident.kind, d.incident.rank, d.incident.step, d.incident.action) == (
        "hang",
        1,
        6,
        "restart",
    )
    assert [c.type for c in d.commands] == ["job.restart"]
    assert g.jobs[JOB].control.recovering.kind == "restart" and g.jobs[JOB].control.rollbacks == 1
    assert d.commands[0].step == 5
    for dd in out:
        g.mark_published(dd.incident.event_id)
    assert g.check_hangs(at(30.0)) == []
    # the relaunch (attempt 2) starts a fresh watch of the job
    feed(g, [launch(2, attempt=2, t=31.0, hang_timeout_s=10)])
    assert g.jobs[JOB].control.attempt == 2 and g.jobs[JOB].control.recovering is None
    assert feed(g, [step(6, 0, math.nan, t=0.6)]) == []  # attempt 1: stale


def test_ranks_past_the_jobs_last_step_are_held_to_the_plain_timeout_not_the_step_multiple():
    # The job's last step is 5: after it, the ranks save and exit, which is not a step. On a busy
    # machine that took longer than 5 step times, and a finished job was halted as hung.
    g = Guardian()
    feed(g, [launch(2, hang_timeout_s=30, steps=6)])
    feed(g, normal_steps(0, 6))  # steps 0..5 from both ranks, 0.1 s apart
    assert g.check_hangs(at(10.0)) == []  # past the floor, within the 30 s timeout
    out = g.check_hangs(at(40.0))  # a rank that never exits is still a hang, after the timeout
    assert len(out) == 1 and out[0].incident.kind == "hang"
    assert out[0].incident.evidence["limit_s"] == 30


def test_a_launched_rank_that_never_starts_is_a_hang_after_the_start_up_limit():
    g = started(
        hang_timeout_s=5, startup_timeout_s=30
    )  # launched at 0.0, with checkpoints 0 and 5 from before
    feed(g, [RankStarted(job_id=JOB, attempt=1, rank=0, node="n0", pid=1, log_path="-", occurred_at=at(1))])
    assert g.check_hangs(at(29.0)) == []  # starting may take a while
    out = g.check_hangs(at(31.0))
    assert len(out) == 1
    d = out[0]
    assert (d.incident.kind, d.incident.rank, d.incident.node) == ("hang", 1, "n1")
    assert "rank 1 on n1 has not started 31.0s after the launch (start-up limit 30.0s" in d.incident.message
    assert d.incident.evidence["not_started"] == [1] and d.incident.evidence["phase"] == "not_started"
    assert d.commands[0].type == "job.restart"  # relaunched (a new attempt), from the newest checkpoint
    g.mark_published(d.incident.event_id)
    assert g.check_hangs(at(60.0)) == []  # one incident


def test_no_hang_within_the_timeout_or_while_halted():
    g = started(hang_timeout_s=5)
    started_at = at(0.05)
    feed(
        g,
        [
            RankStarted(job_id=JOB, attempt=1, rank=r, node="n", pid=1, log_path="-", occurred_at=started_at)
            for r in (0, 1)
        ],
    )
    assert g.check_hangs(at(5.0)) == []  # every rank started, no step yet: within the timeout
    feed(g, normal_steps(0, 3))
    feed(g, [JobStateChanged(job_id=JOB, attempt=1, from_state="RUNNING", to_state="HALTED", cause="op")])
    assert g.check_hangs(at(100.0)) == []


def test_rank_exit_alerts_unless_vigil_killed_it():
    g = started()
    bad = RankExited(job_id=JOB, attempt=1, rank=1, node="n1", exit_code=3, failure="error", last_step=4)
    out = feed(g, [bad])
    assert [(d.incident.kind, d.incident.action, d.incident.rank) for d in out] == [("rank_exit", "alert", 1)]
    assert feed(g, [bad]) == []  # redelivered: same incident, already out
    killed = RankExited(
        job_id=JOB, attempt=1, rank=0, node="n0", exit_code=None, signal=15, failure="killed_by_vigil"
    )
    assert feed(g, [killed]) == []


def test_gpu_health_on_a_busy_device_follows_the_jobs_policy():
    g = started(gpu_health="rollback")
    feed(g, normal_steps(0, 7))
    out = feed(g, [gpu(node="n1", index=0, temperature_c=99.0, occurred_at=at(0.75))], now=at(0.75))
    assert len(out) == 1
    d = out[0]
    assert (d.incident.kind, d.incident.job_id, d.incident.node, d.incident.device, d.incident.rank) == (
        "gpu_health",
        JOB,
        "n1",
        0,
        1,
    )
    assert d.commands[0].type == "job.restart" and d.commands[0].step == 5
    idle = feed(g, [gpu(node="n9", index=3, xid=79)])
    assert idle[0].incident.job_id is None and idle[0].incident.device == 3 and idle[0].commands == ()


def test_restart_rebuilds_windows_by_quiet_replay_and_misses_nothing():
    g = started(spike_warmup=10)
    history = normal_steps(0, 20)
    feed(g, history)
    snap = g.jobs[JOB].control.snapshot()
    # a new guardian: control state from the snapshot, windows from a quiet replay of the steps
    g2 = Guardian()
    g2.jobs[JOB] = JobWatch(JOB, Control.restore(snap))
    for e in history:
        assert g2.on_event(e, e.occurred_at, quiet=True) == []
    assert g2.jobs[JOB].control.checkpoints == {0: "/c/step_00000000", 5: "/c/step_00000005"}
    out = feed(g2, [step(20, 0, 200.0, t=2.0)], now=at(2.01))
    assert [d.incident.kind for d in out] == ["spike"]  # the window was rebuilt: no warm-up again


def test_snapshot_round_trip_keeps_recovery():
    g = started()
    feed(g, normal_steps(0, 7))
    feed(g, [step(7, 0, math.nan, t=0.7)], now=at(0.71))
    w = JobWatch(JOB, Control.restore(g.jobs[JOB].control.snapshot()))
    assert w.control.recovering == g.jobs[JOB].control.recovering and w.control.rollbacks == 1
    assert w.control.snapshot() == g.jobs[JOB].control.snapshot()
    # the in-flight event (redelivered after the restart) stays quiet
    assert w.on_step(step(7, 1, math.nan, t=0.7), at(1.0)) == []


def test_a_rollback_that_never_completes_is_a_hang_after_the_timeout():
    g = started(hang_timeout_s=30)
    feed(g, normal_steps(0, 7))
    feed(g, [step(7, 0, math.nan, t=0.7)], now=at(0.71))
    assert g.check_hangs(at(20.0)) == []  # no step-time multiple: loading a checkpoint may be slow
    out = g.check_hangs(at(31.0))
    assert len(out) == 1
    d = out[0]
    assert d.incident.kind == "hang" and "rollback to step 5 has not completed" in d.incident.message
    assert d.commands[0].type == "job.restart" and d.commands[0].step == 5


def replayed(s, outcome="transient", rank=1, t=0.0, kind="nan"):
    return StepReplayed(
        job_id=JOB,
        attempt=1,
        step=s,
        node="n0",
        kind=kind,
        outcome=outcome,
        culprits=[rank],
        values=[RankValue(rank=rank, first=None, replay=2.5)],
        data_position=s,
        skip_data=(s, s + 1) if outcome == "reproduced" else None,
        held_s=0.2,
        occurred_at=at(t),
    )


def test_a_held_step_is_an_incident_naming_the_device_and_what_the_replay_showed():
    g = started()
    feed(g, normal_steps(0, 8))
    (d,) = feed(g, [replayed(8, t=0.9)])
    inc = d.incident
    assert (inc.kind, inc.action, inc.step, inc.rank, inc.node, inc.device) == (
        "nan",
        "replay",
        8,
        1,
        "n1",
        0,
    )
    assert "transient on rank 1, GPU 0 of node n1: replay clean" in inc.message and d.commands == ()
    skipped = replayed(9, "reproduced", t=1.0, kind="spike")
    (d,) = feed(g, [skipped])
    assert (d.incident.kind, d.incident.action) == ("spike", "skip") and d.commands == ()
    assert "reproduced on rank 1, GPU 0 of node n1: data 9..9 skipped" in d.incident.message
    assert feed(g, [skipped]) == []  # redelivered: published once


def test_a_second_transient_fault_on_one_device_relaunches_the_job_without_it():
    g = started(sdc_strikes=2)
    feed(g, normal_steps(0, 12))
    assert [d.action for d in feed(g, [replayed(6, t=0.7)])] == ["replay"]
    assert [d.action for d in feed(g, [replayed(7, rank=0, t=0.8)])] == ["replay"]  # another device
    replay, excluded = feed(g, [replayed(11, t=1.2)])
    assert replay.action == "replay" and excluded.incident.kind == "sdc" and excluded.action == "restart"
    (restart,) = excluded.commands
    assert restart.type == "job.restart" and restart.unhealthy == [("n1", 0)] and restart.step == 5
    assert excluded.incident.evidence["strikes"] == [6, 11] and excluded.incident.device == 0


def test_strikes_outside_the_window_do_not_add_up():
    g = started(sdc_strikes=2, sdc_window=3)
    feed(g, normal_steps(0, 12))
    assert [d.action for d in feed(g, [replayed(6, t=0.7), replayed(10, t=1.1)])] == ["replay", "replay"]
