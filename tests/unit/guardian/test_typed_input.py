"""Every member of the guardian's input union reaches a branch of its receivers' `match` (mypy checks the
same statically, `assert_never`), and each branch does what it is for: the decisions it gives, or the
state it changes. A member falling through to the default branch would give neither."""

from collections.abc import Callable
from typing import get_args

import pytest

from tests.unit.common.samples import SAMPLES, T0
from vigil import events as ev
from vigil.errors import MalformedMessage
from vigil.jobstates import JobState
from vigil_guardian.core import Guardian
from vigil_guardian.watch import JobWatch

JOB = SAMPLES[ev.LaunchJob].job_id
Check = Callable[[Guardian], bool]


def watch(g: Guardian) -> JobWatch:
    return g.jobs[JOB]


# Each input: the (incident kind, action) of the decisions it gives at once, and what it changed.
EXPECTED: dict[type, tuple[list[tuple[str, str]], Check]] = {
    ev.LaunchJob: ([], lambda g: watch(g).control.world_size == len(SAMPLES[ev.LaunchJob].placement)),
    ev.StepCompleted: ([], lambda g: watch(g).windows.progress[SAMPLES[ev.StepCompleted].rank][1] == 41),
    ev.RankStarted: ([], lambda g: watch(g).control.started == {0}),
    ev.RankExited: (
        [("rank_exit", "alert")],
        lambda g: SAMPLES[ev.RankExited].rank in watch(g).control.exited,
    ),
    ev.CheckpointSaved: (
        [],
        lambda g: (
            watch(g).control.checkpoints == {20: "/ckpt/j/step_00000020"}
            and watch(g).control.checkpoint_bytes == 123456
        ),
    ),
    ev.RanksHalted: ([], lambda g: watch(g).control.state == JobState.HALTED),
    ev.RollbackCompleted: (
        [],
        lambda g: watch(g).control.state == JobState.RUNNING and watch(g).control.generation == 1,
    ),
    ev.RestartRequested: ([], lambda g: watch(g).control.recovering is None),  # the scheduler relaunches
    ev.OutOfMemoryHalted: ([("oom", "halt")], lambda g: True),
    ev.StepReplayed: (
        [("spike", "replay")],
        lambda g: SAMPLES[ev.StepReplayed].step in watch(g).windows.held,
    ),
    ev.ReportRefused: ([("report_refused", "alert")], lambda g: True),
    ev.CheckpointRefused: (
        [],
        lambda g: SAMPLES[ev.CheckpointRefused].step not in watch(g).control.checkpoints,
    ),
    ev.DeviceDiagnosed: ([("sdc", "alert")], lambda g: True),
    ev.StacksDumped: ([], lambda g: watch(g).stack_wait is None),  # no hang asked for it: dropped
    ev.JobStateChanged: ([], lambda g: watch(g).control.state == JobState.HALTED),
    ev.GuardianSettingsChanged: (
        [],
        lambda g: watch(g).control.spec.spike_zscore == 4.0 and watch(g).control.retuned is not None,
    ),
    ev.GpuSampled: ([], lambda g: ("n1", 0) in g.devices.health),
}


def test_every_input_has_its_expectation():
    assert set(EXPECTED) == set(get_args(ev.GuardianInput))


@pytest.mark.parametrize("cls", get_args(ev.GuardianInput), ids=lambda c: c.__name__)
def test_each_member_of_the_guardians_input_is_judged(cls):
    g = Guardian()
    g.on_event(SAMPLES[ev.LaunchJob], T0)
    out = g.on_event(SAMPLES[cls], T0)
    decisions, changed = EXPECTED[cls]
    assert [(d.incident.kind, d.incident.action) for d in out] == decisions
    assert changed(g), cls.__name__


@pytest.mark.parametrize("cls", ev.STATUS_EVENTS, ids=lambda c: c.__name__)
def test_each_status_event_has_its_branch_in_on_status(cls):
    w = JobWatch(JOB)
    w.on_launch(SAMPLES[ev.LaunchJob])
    out = w.on_status(SAMPLES[cls], T0)
    assert [(d.incident.kind, d.incident.action) for d in out] == EXPECTED[cls][0]


def test_a_message_outside_the_union_is_refused_by_name():
    with pytest.raises(MalformedMessage, match=r"HaltJob .* is not a guardian input"):
        ev.expect(SAMPLES[ev.HaltJob], ev.is_guardian_input, "guardian input")
