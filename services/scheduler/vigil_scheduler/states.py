"""The job state machine: which transitions exist, and what every event does in every state. Pure.

    PENDING -> SCHEDULED -> RUNNING -> SUCCEEDED | FAILED | CANCELLED
    RUNNING -> HALTED -> ROLLING_BACK -> RUNNING
    ROLLING_BACK -> SCHEDULED            (a restart: the new attempt is placed and launched)
    RUNNING -> ROLLING_BACK              (an elastic job running shrunk grows back at a checkpoint: the
                                          next attempt, at its whole size, from that checkpoint)
    ROLLING_BACK -> ROLLING_BACK         (a restart asked for during an in-place rollback: its program
                                          cannot load in place; the next attempt, from the checkpoint)
    HALTED | ROLLING_BACK -> SUCCEEDED   (the ranks finished before the rollback reached them, and the bad
                                          step's update was never applied)
    SCHEDULED | RUNNING | HALTED | ROLLING_BACK -> PENDING   (requeued with attempt + 1)

Every non-terminal state may also go to FAILED or CANCELLED. The states themselves, which are
terminal and which hold devices, are `vigil.jobstates`.

`OUTCOMES` is the one table of what an event does to a job, for every (phase, event) pair: late,
duplicate and reordered events included. The scheduler's handlers classify what they consume into a
`JobEvent` and do what the table says; a pair that cannot happen is `IMPOSSIBLE`: logged and recorded,
the job unchanged (never a Conflict that dead-letters the event and leaves the job where it was).
Events of an attempt older than the job's are stale and ignored before the table is asked.
"""

from __future__ import annotations

from enum import StrEnum

from vigil.errors import Conflict
from vigil.jobstates import DEVICE_STATES, TERMINAL_STATES, JobState

_ENDS = {JobState.FAILED, JobState.CANCELLED}

TRANSITIONS: dict[JobState, frozenset[JobState]] = {
    JobState.PENDING: frozenset({JobState.SCHEDULED} | _ENDS),
    # HALTED / ROLLING_BACK from SCHEDULED: a guardian command may overtake the last RankStarted.
    JobState.SCHEDULED: frozenset(
        {JobState.RUNNING, JobState.HALTED, JobState.ROLLING_BACK, JobState.PENDING, JobState.SUCCEEDED}
        | _ENDS
    ),
    JobState.RUNNING: frozenset(
        {JobState.HALTED, JobState.ROLLING_BACK, JobState.PENDING, JobState.SUCCEEDED} | _ENDS
    ),
    JobState.HALTED: frozenset(
        {JobState.ROLLING_BACK, JobState.RUNNING, JobState.PENDING, JobState.SUCCEEDED} | _ENDS
    ),
    # ROLLING_BACK again: the ranks of an in-place rollback answered that their program cannot load in
    # place (RestartRequested) before their halt was reported; the restart is the next attempt.
    JobState.ROLLING_BACK: frozenset(
        {
            JobState.RUNNING,
            JobState.SCHEDULED,
            JobState.HALTED,
            JobState.PENDING,
            JobState.ROLLING_BACK,
            JobState.SUCCEEDED,
        }
        | _ENDS
    ),
    JobState.SUCCEEDED: frozenset(),
    JobState.FAILED: frozenset(),
    JobState.CANCELLED: frozenset(),
}


def allowed(from_state: str, to_state: str) -> bool:
    return to_state in TRANSITIONS[JobState(from_state)]


def check(job_id: str, from_state: str, to_state: str) -> None:
    """Raise Conflict when the job cannot go from `from_state` to `to_state`."""
    if not allowed(from_state, to_state):
        if from_state in TERMINAL_STATES:
            raise Conflict(f"job {job_id} is already {from_state}; it cannot become {to_state}")
        raise Conflict(f"job {job_id} cannot go from {from_state} to {to_state}")


def is_terminal(state: str) -> bool:
    return state in TERMINAL_STATES


def holds_devices(state: str) -> bool:
    return state in DEVICE_STATES


# --- every event in every state ------------------------------------------------------------------------


class Phase(StrEnum):
    """A job's state as the table reads it: ROLLING_BACK is two phases (in place on placed ranks, or a
    restart waiting for its placement), told apart by `Job.queued`."""

    PENDING = "PENDING"
    SCHEDULED = "SCHEDULED"
    RUNNING = "RUNNING"
    HALTED = "HALTED"
    ROLLING_BACK = "ROLLING_BACK"  # in place: the placed ranks load a checkpoint
    RESTARTING = "RESTARTING"  # ROLLING_BACK, queued: the next attempt waits for its placement
    SUCCEEDED = "SUCCEEDED"
    FAILED = "FAILED"
    CANCELLED = "CANCELLED"


def phase(state: str, queued: bool) -> Phase:
    if state == JobState.ROLLING_BACK and queued:
        return Phase.RESTARTING
    return Phase(state)


class JobEvent(StrEnum):
    """What happened to a job's current attempt, as the handlers classify what they consume."""

    PLACED = "placed"  # the placement pass found devices
    RANK_STARTED = "rank_started"  # RankStarted, not yet every rank
    ALL_STARTED = "all_started"  # RankStarted of the last rank
    RANK_FINISHED = "rank_finished"  # RankExited 0, not yet every rank
    ALL_FINISHED = "all_finished"  # RankExited 0 of the last rank: every rank exited 0
    RANK_FAILED = "rank_failed"  # RankExited non-zero or by signal (error, oom, lost, ...)
    RANK_PREEMPTED = "rank_preempted"  # RankExited "preempted": the emergency checkpoint is written
    RANK_ENDED = "rank_ended"  # RankExited "killed_by_vigil", a sibling's report says why
    ALL_ENDED = "all_ended"  # every rank "killed_by_vigil", and none said why
    SPEC_REFUSED = "spec_refused"  # RankExited "spec": no attempt can run
    RANKS_HALTED = "ranks_halted"  # RanksHalted
    ROLLBACK_COMPLETED = "rollback_completed"  # RollbackCompleted
    RESTART_REQUESTED = "restart_requested"  # RestartRequested: the program cannot roll back in place
    INCIDENT_NOTED = "incident_noted"  # the incident behind a halt or rollback: was the update applied
    HALT = "halt"  # HaltJob
    ROLLBACK = "rollback"  # RollbackJob (in place)
    RESTART = "restart"  # RestartJob
    RESUME = "resume"  # ResumeJob
    CANCEL = "cancel"  # CancelJob from another tool
    FAIL = "fail"  # IncidentRaised with action "fail"
    RANKS_LOST = "ranks_lost"  # a node lost, or its worker restarted: the attempt's ranks are gone
    TIMED_OUT = "timed_out"  # the sweeper: no progress for VIGIL_TRANSITION_TIMEOUT_S
    GROW = "grow"  # CheckpointSaved of an elastic job running shrunk whose whole size fits again
    PREEMPT = "preempt"  # the placement pass chose the attempt as a victim for a job of higher priority
    OVER_TIME = "over_time"  # the sweeper: the attempt ran past its time limit (spec, or the default)
    RANK_STOPPED = "rank_stopped"  # a rank of an attempt stopped at its time limit exited, not every rank yet
    ALL_STOPPED = "all_stopped"  # ...every rank of it exited: its emergency checkpoint is written


class Outcome(StrEnum):
    """What the scheduler does (`vigil_scheduler.handlers.Handlers.apply`)."""

    IGNORE = "ignore"  # a duplicate, a late event, or none of this phase's business: nothing changes
    WAIT = "wait"  # recorded (a rank row, progress); the state stays
    IMPOSSIBLE = "impossible"  # cannot happen: logged and recorded, the state stays
    SCHEDULE = "schedule"  # -> SCHEDULED, the attempt launched
    RUN = "run"  # -> RUNNING (every rank started, a rollback completed, resumed)
    HALT = "halt"  # -> HALTED
    ROLL_BACK = "roll_back"  # -> ROLLING_BACK in place; the rollback is remembered for `SETTLE`
    SUCCEED = "succeed"  # -> SUCCEEDED
    REQUEUE = "requeue"  # the next attempt, queued PENDING (or FAILED past VIGIL_MAX_ATTEMPTS)
    RELAUNCH = "relaunch"  # the next attempt from the command's checkpoint, ROLLING_BACK until placed
    GROW = "grow"  # RELAUNCH at the job's whole size from the checkpoint; not counted as a failed attempt
    SETTLE = "settle"  # the ranks finished (or went quiet) during a halt or rollback: `settlement`
    UNQUEUE = "unqueue"  # a restart that found no placement: PENDING, waiting like any queued job
    FAIL = "fail"  # -> FAILED, the ranks cancelled
    CANCEL = "cancel"  # -> CANCELLED
    # the spot path for the attempt's ranks (`PreemptJob`, `vigil_scheduler.preempting.stop`): they finish
    # the step, write the emergency checkpoint and exit `preempted`; the state stays until they have
    STOP = "stop"


_O = Outcome
_E = JobEvent

# Phases whose events can only be late: nothing changes.
_TERMINAL = {e: _O.IGNORE for e in JobEvent}
# A queued attempt has no ranks: a rank's report of it cannot exist (older attempts are filtered).
_QUEUED = {
    **{e: _O.IMPOSSIBLE for e in JobEvent},
    _E.PLACED: _O.SCHEDULE,
    _E.INCIDENT_NOTED: _O.IGNORE,
    # a command about ranks that are not there: nothing to halt, roll back or resume
    _E.HALT: _O.IGNORE,
    _E.ROLLBACK: _O.IGNORE,
    _E.RESTART: _O.IGNORE,
    _E.RESUME: _O.IGNORE,
    _E.RESTART_REQUESTED: _O.IGNORE,  # a duplicate of the one that queued the restart
    _E.CANCEL: _O.CANCEL,
    _E.FAIL: _O.FAIL,
    _E.RANKS_LOST: _O.IGNORE,
    _E.GROW: _O.IGNORE,  # nothing runs shrunk: its placement tries the whole size first anyway
    _E.PREEMPT: _O.IGNORE,  # no ranks to stop (a victim requeued before its preemption was decided)
    _E.OVER_TIME: _O.IGNORE,  # its limit counts from its next start
}
# What ranks on devices do in every placed phase, before each phase's own differences.
_PLACED = {
    _E.PLACED: _O.IMPOSSIBLE,  # only a queued job is placed
    _E.RANK_STARTED: _O.WAIT,
    _E.ALL_STARTED: _O.IGNORE,  # a duplicate, or a command overtook the last start
    _E.RANK_FINISHED: _O.WAIT,
    _E.ALL_FINISHED: _O.SUCCEED,
    _E.RANK_FAILED: _O.REQUEUE,
    _E.RANK_PREEMPTED: _O.REQUEUE,
    _E.RANK_ENDED: _O.WAIT,
    _E.ALL_ENDED: _O.REQUEUE,
    _E.SPEC_REFUSED: _O.FAIL,
    _E.RANKS_HALTED: _O.IGNORE,
    _E.ROLLBACK_COMPLETED: _O.WAIT,  # remembered: its RollbackJob, if it comes later, changes nothing
    _E.RESTART_REQUESTED: _O.RELAUNCH,
    _E.INCIDENT_NOTED: _O.IGNORE,
    _E.HALT: _O.HALT,
    _E.ROLLBACK: _O.ROLL_BACK,
    _E.RESTART: _O.RELAUNCH,
    _E.RESUME: _O.IGNORE,
    _E.CANCEL: _O.CANCEL,
    _E.FAIL: _O.FAIL,
    _E.RANKS_LOST: _O.REQUEUE,
    _E.TIMED_OUT: _O.IGNORE,
    # only a running job grows: not one whose ranks are still starting, halted or rolling back (its
    # next checkpoint, once it runs again, is the next chance)
    _E.GROW: _O.IGNORE,
    # only a running job is stopped on the spot path: ranks starting, halted or rolling back are at no step
    # boundary that takes the notice (a preemption picks another victim; the limit is enforced once it runs)
    _E.PREEMPT: _O.IGNORE,
    _E.OVER_TIME: _O.IGNORE,
    _E.RANK_STOPPED: _O.WAIT,  # its siblings write their part of the emergency checkpoint
    _E.ALL_STOPPED: _O.FAIL,  # ended at its time limit (not requeued), the checkpoint kept to resume from
}

OUTCOMES: dict[Phase, dict[JobEvent, Outcome]] = {
    Phase.PENDING: {**_QUEUED, _E.TIMED_OUT: _O.IGNORE},  # waiting for devices is not stuck
    Phase.SCHEDULED: {
        **_PLACED,
        _E.ALL_STARTED: _O.RUN,
        # the ranks halted before their starts were all reported: the HaltJob moves the job
        _E.RANKS_HALTED: _O.IGNORE,
        _E.TIMED_OUT: _O.REQUEUE,  # launched, but a rank's start never came
    },
    Phase.RUNNING: {
        **_PLACED,
        _E.RANKS_HALTED: _O.HALT,  # the HaltJob may still be on its way
        _E.GROW: _O.GROW,
        _E.PREEMPT: _O.STOP,
        _E.OVER_TIME: _O.STOP,
    },
    Phase.HALTED: {
        **_PLACED,
        # every rank exited 0 before the rollback (which may still come) reached them
        _E.ALL_FINISHED: _O.SETTLE,
        _E.INCIDENT_NOTED: _O.SETTLE,
        _E.RANKS_HALTED: _O.WAIT,  # halting finished: they wait for a rollback, a resume or a cancel
        _E.ROLLBACK_COMPLETED: _O.RUN,
        _E.HALT: _O.IGNORE,  # a duplicate
        _E.RESUME: _O.RUN,
        # halting that never finished, or finished ranks nobody resolved (a halt with ranks halted and
        # alive waits for its operator: not swept)
        _E.TIMED_OUT: _O.SETTLE,
    },
    Phase.ROLLING_BACK: {
        **_PLACED,
        _E.ALL_FINISHED: _O.SETTLE,  # the ranks finished before the rollback reached them
        _E.RANKS_HALTED: _O.WAIT,  # the halt before the rollback: progress
        _E.INCIDENT_NOTED: _O.SETTLE,
        _E.ROLLBACK_COMPLETED: _O.RUN,
        _E.ROLLBACK: _O.IGNORE,  # a duplicate, or a second one while the first runs
        _E.TIMED_OUT: _O.SETTLE,  # the rollback never completed: relaunch from its checkpoint
    },
    Phase.RESTARTING: {**_QUEUED, _E.TIMED_OUT: _O.UNQUEUE},
    Phase.SUCCEEDED: _TERMINAL,
    Phase.FAILED: _TERMINAL,
    Phase.CANCELLED: _TERMINAL,
}


def outcome(state: str, queued: bool, event: JobEvent) -> Outcome:
    """What `event` does to a job in `state` (`queued`: waiting for a placement)."""
    return OUTCOMES[phase(state, queued)][event]


# Phases the sweeper watches: a job there must make progress within VIGIL_TRANSITION_TIMEOUT_S.
SWEPT: frozenset[Phase] = frozenset(p for p, row in OUTCOMES.items() if row[_E.TIMED_OUT] != _O.IGNORE)


# --- a halt or rollback whose ranks finished ----------------------------------------------------------------


class Settlement(StrEnum):
    WAIT = "wait"  # not yet: the ranks run on, or the rollback or its incident is still on its way
    SUCCEED = "succeed"  # the bad step's update was never applied: what the ranks finished is good
    RELAUNCH = "relaunch"  # the next attempt, from the rollback's checkpoint (or the newest valid one)
    FAIL = "fail"  # halted, finished with the bad update applied, and no rollback asked for


def settlement(
    *,
    finished: bool,
    exited: bool,
    rollback: bool,
    halted: bool,
    unapplied: bool | None,
    timed_out: bool,
) -> Settlement:
    """What to do with a halted or rolling-back attempt (`SETTLE`).

    Args:
        finished: every rank exited 0.
        exited: at least one rank exited 0 (the others' exits may never be reported).
        rollback: a RollbackJob is under way (else a HaltJob alone).
        halted: the ranks reported that they halted (RanksHalted) and wait there.
        unapplied: the bad step's update was never applied (held, or skipped as non-finite); None while
            the incident that says so is unknown (it may still be on its way).
        timed_out: the sweeper's bound passed without progress.
    """
    if not timed_out and not finished:
        return Settlement.WAIT  # ranks still run: the rollback or halt reaches them, or the sweeper
    if not (finished or exited):
        if halted and not rollback:
            return Settlement.WAIT  # halted ranks wait for their operator (resume, rollback or cancel)
        return Settlement.RELAUNCH  # ranks that never halted, or never finished their rollback
    if unapplied:
        return Settlement.SUCCEED
    if not timed_out and (not rollback or unapplied is None):
        return Settlement.WAIT  # the rollback or its incident comes right after the halt
    return Settlement.RELAUNCH if rollback else Settlement.FAIL
