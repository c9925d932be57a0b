"""The job state machine: which transitions exist. Pure.

    PENDING -> SCHEDULED -> RUNNING -> SUCCEEDED | FAILED | CANCELLED
    RUNNING -> HALTED -> ROLLING_BACK -> RUNNING
    ROLLING_BACK -> SCHEDULED            (a restart: the new attempt is placed and launched)
    ROLLING_BACK -> ROLLING_BACK         (a restart asked for during an in-place rollback: its program
                                          cannot load in place; the next attempt, from the checkpoint)
    SCHEDULED | RUNNING | HALTED | ROLLING_BACK -> PENDING   (requeued with attempt + 1)

Every non-terminal state may also go to FAILED or CANCELLED. The states themselves, which are
terminal and which hold devices, are `vigil_common.jobstates`.
"""

from __future__ import annotations

from vigil_common.errors import Conflict
from vigil_common.jobstates import DEVICE_STATES, TERMINAL_STATES, JobState

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
    JobState.HALTED: frozenset({JobState.ROLLING_BACK, JobState.RUNNING, JobState.PENDING} | _ENDS),
    # ROLLING_BACK again: the ranks of an in-place rollback answered that their program cannot load in
    # place (RestartRequested) before their halt was reported; the restart is the next attempt.
    JobState.ROLLING_BACK: frozenset(
        {JobState.RUNNING, JobState.SCHEDULED, JobState.HALTED, JobState.PENDING, JobState.ROLLING_BACK}
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
