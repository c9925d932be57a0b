"""The job state machine's one table: every (phase, event) pair has an outcome that the transitions
allow, and no order of late, duplicate or reordered events leaves a job in a transition once the
sweeper has looked (a model of the handlers' I/O shell around the pure table)."""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from vigil.jobstates import JobState
from vigil_scheduler.states import (
    OUTCOMES,
    SWEPT,
    JobEvent,
    Outcome,
    Phase,
    Settlement,
    allowed,
    outcome,
    phase,
    settlement,
)

# The state each outcome moves a job to (None: it stays; REQUEUE/RELAUNCH/SETTLE/UNQUEUE: several).
_TO = {
    Outcome.SCHEDULE: JobState.SCHEDULED,
    Outcome.RUN: JobState.RUNNING,
    Outcome.HALT: JobState.HALTED,
    Outcome.ROLL_BACK: JobState.ROLLING_BACK,
    Outcome.SUCCEED: JobState.SUCCEEDED,
    Outcome.FAIL: JobState.FAILED,
    Outcome.CANCEL: JobState.CANCELLED,
    Outcome.UNQUEUE: JobState.PENDING,
}
_STATE_OF = {p: JobState.ROLLING_BACK if p == Phase.RESTARTING else JobState(p) for p in Phase}


def test_every_phase_has_an_outcome_for_every_event() -> None:
    assert set(OUTCOMES) == set(Phase)
    for p, row in OUTCOMES.items():
        assert set(row) == set(JobEvent), p


@pytest.mark.parametrize("p", list(Phase))
def test_every_outcome_is_a_transition_the_machine_allows(p: Phase) -> None:
    state = _STATE_OF[p]
    for event, result in OUTCOMES[p].items():
        if result in _TO:
            assert allowed(state, _TO[result]), (p, event, result)
        if result in (Outcome.REQUEUE, Outcome.RELAUNCH, Outcome.SETTLE, Outcome.GROW):
            assert allowed(state, JobState.FAILED), (p, event)
            target = JobState.PENDING if result == Outcome.REQUEUE else JobState.ROLLING_BACK
            assert allowed(state, target), (p, event, result)
        if result == Outcome.SETTLE:
            assert allowed(state, JobState.SUCCEEDED), (p, event)


def test_an_ended_job_ignores_every_late_event() -> None:
    for p in (Phase.SUCCEEDED, Phase.FAILED, Phase.CANCELLED):
        assert set(OUTCOMES[p].values()) == {Outcome.IGNORE}


@pytest.mark.parametrize(
    ("state", "queued", "event", "expected"),
    [
        # issue 32: the last rank's exit 0 during a rollback or halt was a Conflict, dead-lettered
        (JobState.ROLLING_BACK, False, JobEvent.ALL_FINISHED, Outcome.SETTLE),
        (JobState.HALTED, False, JobEvent.ALL_FINISHED, Outcome.SETTLE),
        (JobState.RUNNING, False, JobEvent.ALL_FINISHED, Outcome.SUCCEED),
        (JobState.SCHEDULED, False, JobEvent.ALL_FINISHED, Outcome.SUCCEED),
        # duplicates and reorderings
        (JobState.RUNNING, False, JobEvent.ALL_STARTED, Outcome.IGNORE),
        (JobState.HALTED, False, JobEvent.HALT, Outcome.IGNORE),
        (JobState.ROLLING_BACK, False, JobEvent.ROLLBACK, Outcome.IGNORE),
        (JobState.HALTED, False, JobEvent.ALL_STARTED, Outcome.IGNORE),
        (JobState.SCHEDULED, False, JobEvent.HALT, Outcome.HALT),
        (JobState.RUNNING, False, JobEvent.RANKS_HALTED, Outcome.HALT),
        (JobState.RUNNING, False, JobEvent.ROLLBACK_COMPLETED, Outcome.WAIT),
        (JobState.SUCCEEDED, False, JobEvent.ROLLBACK, Outcome.IGNORE),
        # a restart waiting for its placement
        (JobState.ROLLING_BACK, True, JobEvent.PLACED, Outcome.SCHEDULE),
        (JobState.ROLLING_BACK, True, JobEvent.RESTART_REQUESTED, Outcome.IGNORE),
        (JobState.ROLLING_BACK, True, JobEvent.RANK_FAILED, Outcome.IMPOSSIBLE),
        (JobState.ROLLING_BACK, True, JobEvent.TIMED_OUT, Outcome.UNQUEUE),
        (JobState.PENDING, True, JobEvent.RANK_STARTED, Outcome.IMPOSSIBLE),
        # the sweeper
        (JobState.PENDING, True, JobEvent.TIMED_OUT, Outcome.IGNORE),
        (JobState.RUNNING, False, JobEvent.TIMED_OUT, Outcome.IGNORE),
        (JobState.SCHEDULED, False, JobEvent.TIMED_OUT, Outcome.REQUEUE),
        (JobState.ROLLING_BACK, False, JobEvent.TIMED_OUT, Outcome.SETTLE),
        # elastic grow: a running job only; never one starting, halted, rolling back, queued or ended
        (JobState.RUNNING, False, JobEvent.GROW, Outcome.GROW),
        (JobState.SCHEDULED, False, JobEvent.GROW, Outcome.IGNORE),
        (JobState.HALTED, False, JobEvent.GROW, Outcome.IGNORE),
        (JobState.ROLLING_BACK, False, JobEvent.GROW, Outcome.IGNORE),
        (JobState.ROLLING_BACK, True, JobEvent.GROW, Outcome.IGNORE),
        (JobState.PENDING, True, JobEvent.GROW, Outcome.IGNORE),
        (JobState.SUCCEEDED, False, JobEvent.GROW, Outcome.IGNORE),
        # issue 41: a preemption or a time limit stops a running attempt only; at its limit it then ends
        (JobState.RUNNING, False, JobEvent.PREEMPT, Outcome.STOP),
        (JobState.RUNNING, False, JobEvent.OVER_TIME, Outcome.STOP),
        (JobState.SCHEDULED, False, JobEvent.PREEMPT, Outcome.IGNORE),
        (JobState.HALTED, False, JobEvent.OVER_TIME, Outcome.IGNORE),
        (JobState.PENDING, True, JobEvent.PREEMPT, Outcome.IGNORE),
        (JobState.ROLLING_BACK, True, JobEvent.OVER_TIME, Outcome.IGNORE),
        (JobState.SUCCEEDED, False, JobEvent.PREEMPT, Outcome.IGNORE),
        (JobState.RUNNING, False, JobEvent.RANK_STOPPED, Outcome.WAIT),
        (JobState.RUNNING, False, JobEvent.ALL_STOPPED, Outcome.FAIL),
        (JobState.PENDING, True, JobEvent.ALL_STOPPED, Outcome.IMPOSSIBLE),
        (JobState.FAILED, False, JobEvent.ALL_STOPPED, Outcome.IGNORE),
    ],
)
def test_pairs(state: JobState, queued: bool, event: JobEvent, expected: Outcome) -> None:
    assert outcome(state, queued, event) == expected


def test_the_sweeper_watches_exactly_the_transitional_phases() -> None:
    assert {Phase.SCHEDULED, Phase.HALTED, Phase.ROLLING_BACK, Phase.RESTARTING} == SWEPT


@pytest.mark.parametrize(
    ("finished", "exited", "rollback", "halted", "unapplied", "timed_out", "expected"),
    [
        (True, True, True, False, True, False, Settlement.SUCCEED),  # skipped NaN on the last step
        (True, True, True, False, False, False, Settlement.RELAUNCH),  # the update was applied
        (True, True, True, False, None, False, Settlement.WAIT),  # its incident is on its way
        (True, True, True, False, None, True, Settlement.RELAUNCH),  # ...and never came
        (False, True, True, False, True, True, Settlement.SUCCEED),  # rank 1's exit never reported
        (False, True, True, False, False, True, Settlement.RELAUNCH),
        (False, False, True, False, None, True, Settlement.RELAUNCH),  # the rollback never completed
        (False, False, False, False, None, True, Settlement.RELAUNCH),  # the ranks never halted
        (False, False, False, True, None, True, Settlement.WAIT),  # halted, for the operator
        (True, True, False, True, None, False, Settlement.WAIT),  # the halt's rollback may follow
        (True, True, False, False, False, True, Settlement.FAIL),  # halt only, bad update applied
        (False, True, True, False, True, False, Settlement.WAIT),  # a rank still runs
    ],
)
def test_settlement(
    finished: bool,
    exited: bool,
    rollback: bool,
    halted: bool,
    unapplied: bool | None,
    timed_out: bool,
    expected: Settlement,
) -> None:
    got = settlement(
        finished=finished,
        exited=exited,
        rollback=rollback,
        halted=halted,
        unapplied=unapplied,
        timed_out=timed_out,
    )
    assert got == expected


# --- a model of the handlers around the table ----------------------------------------------------------


@dataclass(frozen=True)
class Model:
    """A two-rank job as the scheduler sees it: state, queued, what its ranks reported, its recovery."""

    state: JobState = JobState.RUNNING
    queued: bool = False
    attempt: int = 1
    ok: frozenset[int] = frozenset()
    rollback: bool = False
    halted: bool = False
    unapplied: bool | None = None  # the incident's word, once noted
    log: tuple[str, ...] = field(default=())

    def apply(self, event: JobEvent, *, command_incident: bool = True) -> Model:
        result = outcome(self.state, self.queued, event)
        m = replace(self, log=(*self.log, f"{self.state}/{event}->{result}"))
        match result:
            case Outcome.WAIT if event == JobEvent.RANKS_HALTED:
                return replace(m, halted=True)
            case Outcome.IGNORE | Outcome.WAIT | Outcome.IMPOSSIBLE | Outcome.STOP:
                return m  # STOP: the notice goes to the ranks; their exits move the job
            case Outcome.RUN:
                m = replace(m, state=JobState.RUNNING, rollback=False, halted=False)
            case Outcome.HALT:
                m = replace(m, state=JobState.HALTED, halted=m.halted or event == JobEvent.RANKS_HALTED)
            case Outcome.ROLL_BACK:
                m = replace(m, state=JobState.ROLLING_BACK, rollback=True)
            case Outcome.SUCCEED:
                return replace(m, state=JobState.SUCCEEDED)
            case Outcome.REQUEUE:
                return replace(m, state=JobState.PENDING, queued=True, attempt=m.attempt + 1, ok=frozenset())
            case Outcome.RELAUNCH | Outcome.GROW:
                return m.relaunched()
            case Outcome.SETTLE:
                return m.settle(timed_out=event == JobEvent.TIMED_OUT)
            case Outcome.UNQUEUE:
                return replace(m, state=JobState.PENDING)
            case Outcome.FAIL:
                return replace(m, state=JobState.FAILED)
            case Outcome.CANCEL:
                return replace(m, state=JobState.CANCELLED)
            case Outcome.SCHEDULE:
                return replace(m, state=JobState.SCHEDULED, queued=False)
        if len(m.ok) == 2:  # the post-check after RUN and ROLL_BACK
            return m.apply(JobEvent.ALL_FINISHED)
        return m

    def relaunched(self) -> Model:
        return replace(
            self,
            state=JobState.ROLLING_BACK,
            queued=True,
            attempt=self.attempt + 1,
            ok=frozenset(),
            rollback=False,
        )

    def settle(self, *, timed_out: bool) -> Model:
        decided = settlement(
            finished=len(self.ok) == 2,
            exited=bool(self.ok),
            rollback=self.rollback,
            halted=self.halted,
            unapplied=self.unapplied,
            timed_out=timed_out,
        )
        match decided:
            case Settlement.WAIT:
                return self
            case Settlement.SUCCEED:
                return replace(self, state=JobState.SUCCEEDED)
            case Settlement.RELAUNCH:
                return self.relaunched()
            case Settlement.FAIL:
                return replace(self, state=JobState.FAILED)

    def exit_ok(self, rank: int) -> Model:
        if self.queued or self.attempt != 1 or self.state in (JobState.SUCCEEDED, JobState.FAILED):
            return self  # a later attempt: this report is stale
        ok = self.ok | {rank}
        return replace(self, ok=ok).apply(JobEvent.ALL_FINISHED if len(ok) == 2 else JobEvent.RANK_FINISHED)

    def note(self, unapplied: bool) -> Model:
        if self.attempt != 1:
            return self
        return replace(self, unapplied=unapplied).apply(JobEvent.INCIDENT_NOTED)

    def current(self, event: JobEvent) -> Model:
        return self.apply(event) if self.attempt == 1 else self


# What a NaN on the very last step sends the scheduler: both ranks exit 0, the guardian's halt and
# rollback, and the incident saying whether the update was applied; any of the exits may be lost.
LAST_STEP = ["exit0", "exit1", "halt", "rollback", "incident"]


def run(order: list[str], *, unapplied: bool, lost: set[str]) -> Model:
    m = Model()
    for name in order:
        if name in lost:
            continue
        match name:
            case "exit0":
                m = m.exit_ok(0)
            case "exit1":
                m = m.exit_ok(1)
            case "halt":
                m = m.current(JobEvent.HALT)
            case "rollback":
                m = m.current(JobEvent.ROLLBACK)
            case "incident":
                m = m.note(unapplied)
    if phase(m.state, m.queued) in SWEPT and not m.queued:  # the sweeper, before any relaunch is placed
        m = m.current(JobEvent.TIMED_OUT)
    return m


@settings(max_examples=400, deadline=None)
@given(
    order=st.permutations(LAST_STEP),
    unapplied=st.booleans(),
    lost=st.sets(st.sampled_from(["exit1", "incident"]), max_size=2),
)
def test_no_order_of_a_last_step_nan_leaves_the_job_in_a_transition(
    order: list[str], unapplied: bool, lost: set[str]
) -> None:
    m = run(list(order), unapplied=unapplied, lost=lost)
    # the ranks finished: the job succeeded, or a relaunch from the checkpoint waits in the queue
    assert m.state == JobState.SUCCEEDED or (m.queued and m.attempt == 2), m.log
    if unapplied and "incident" not in lost:  # the update was never applied, and we heard so
        assert m.state == JobState.SUCCEEDED, m.log


def test_a_skipped_nan_on_the_last_step_succeeds_whatever_the_order() -> None:
    for order in (
        ["exit0", "halt", "rollback", "exit1", "incident"],  # issue 32's order
        ["exit0", "halt", "exit1", "rollback", "incident"],
        ["halt", "rollback", "incident", "exit0", "exit1"],
        ["exit0", "halt", "rollback", "incident", "exit1"],
    ):
        m = run(order, unapplied=True, lost=set())
        assert m.state == JobState.SUCCEEDED, (order, m.log)


def test_an_applied_nan_on_the_last_step_relaunches_from_the_checkpoint() -> None:
    m = run(["exit0", "halt", "rollback", "exit1", "incident"], unapplied=False, lost=set())
    assert m.state == JobState.ROLLING_BACK and m.queued and m.attempt == 2, m.log


def test_a_rank_whose_exit_is_never_reported_is_swept() -> None:
    m = run(["exit0", "halt", "rollback", "incident"], unapplied=True, lost=set())
    assert m.state == JobState.SUCCEEDED and m.log[-1] == "ROLLING_BACK/timed_out->settle", m.log
    m = run(["exit0", "halt", "rollback", "incident"], unapplied=False, lost=set())
    assert m.queued and m.attempt == 2 and m.log[-1] == "ROLLING_BACK/timed_out->settle", m.log


@given(events=st.lists(st.sampled_from(list(JobEvent)), max_size=12))
def test_after_any_events_the_sweeper_leaves_no_job_in_a_transition(events: list[JobEvent]) -> None:
    """Random events, in any order and repeated: every one has an outcome, and once the sweeper has looked
    the job is out of every transitional phase, or halted with its ranks waiting for their operator."""
    m = Model()
    for event in events:
        m = m.apply(event)
    m = m.apply(JobEvent.TIMED_OUT).apply(JobEvent.TIMED_OUT)  # a relaunch's placement is bounded too
    waiting = m.state == JobState.HALTED and m.halted and not m.rollback
    assert phase(m.state, m.queued) not in SWEPT or waiting, m.log


def test_only_a_running_job_grows() -> None:
    growing = {p for p, row in OUTCOMES.items() if row[JobEvent.GROW] != Outcome.IGNORE}
    assert growing == {Phase.RUNNING}
    assert outcome(JobState.RUNNING, False, JobEvent.GROW) == Outcome.GROW


def test_a_grow_waits_in_the_queue_for_its_placement_and_the_sweeper_bounds_it() -> None:
    m = Model().apply(JobEvent.GROW)
    assert (m.state, m.queued, m.attempt) == (JobState.ROLLING_BACK, True, 2), m.log
    assert m.apply(JobEvent.GROW) == replace(m, log=(*m.log, "ROLLING_BACK/grow->ignore"))
    assert m.apply(JobEvent.TIMED_OUT).state == JobState.PENDING  # no placement in time: queued as any job
    assert m.apply(JobEvent.PLACED).state == JobState.SCHEDULED


def test_only_a_running_attempt_is_stopped_on_the_spot_path() -> None:
    for event in (JobEvent.PREEMPT, JobEvent.OVER_TIME):
        stopping = {p for p, row in OUTCOMES.items() if row[event] == Outcome.STOP}
        assert stopping == {Phase.RUNNING}, event
    stopped = Model().apply(JobEvent.PREEMPT)
    assert (stopped.state, stopped.attempt) == (JobState.RUNNING, 1), stopped.log
    assert stopped.apply(JobEvent.RANK_PREEMPTED).queued  # a preemption's exit requeues it
    assert stopped.apply(JobEvent.ALL_STOPPED).state == JobState.FAILED  # a time limit's ends it
