"""Job states: the one vocabulary the scheduler, guardian, telemetry, read model, CLI and database share.

`JobState` is a `StrEnum`: a member is its own name as a string (`JobState.RUNNING == "RUNNING"`),
so JSON, SQL parameters and f-strings carry the plain string. The database agrees: the CHECK
constraints on `jobs.state` and `job_transitions` (migrations 0002 and 0005) list these names,
and a test compares them with this enum.

Which transitions exist is the scheduler's business (`vigil_scheduler.states`); what a state
means to everyone is here.
"""

from __future__ import annotations

from enum import StrEnum


class JobState(StrEnum):
    PENDING = "PENDING"  # waiting for devices (attempt 1, or a requeued attempt)
    SCHEDULED = "SCHEDULED"  # placed and launched; not every rank has started yet
    RUNNING = "RUNNING"
    HALTED = "HALTED"  # every rank stopped at one step boundary, waiting for a rollback or resume
    ROLLING_BACK = "ROLLING_BACK"  # loading a checkpoint in place, or relaunching from it
    SUCCEEDED = "SUCCEEDED"
    FAILED = "FAILED"
    CANCELLED = "CANCELLED"


# A job in one of these has ended for good: no transition leaves them.
TERMINAL_STATES: frozenset[JobState] = frozenset({JobState.SUCCEEDED, JobState.FAILED, JobState.CANCELLED})

# The cause of a transition that ends an attempt on a preemption notice starts with this: the ranks
# wrote the emergency checkpoint and exited (RankExited failure "preempted"); the job is requeued on
# other devices, and such an attempt does not count against VIGIL_MAX_ATTEMPTS.
PREEMPTED = "preempted"

# A job in one of these owns devices (a restart waiting in ROLLING_BACK for its placement keeps
# the last attempt's, so it can be placed on them again); in any other state it owns none.
DEVICE_STATES: frozenset[JobState] = frozenset(
    {JobState.SCHEDULED, JobState.RUNNING, JobState.HALTED, JobState.ROLLING_BACK}
)
