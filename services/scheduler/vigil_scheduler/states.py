"""The job state machine: which transitions exist and which states hold devices. Pure.

    PENDING -> SCHEDULED -> RUNNING -> SUCCEEDED | FAILED | CANCELLED
    RUNNING -> HALTED -> ROLLING_BACK -> RUNNING
    ROLLING_BACK -> SCHEDULED            (a restart: the new attempt is placed and launched)
    SCHEDULED | RUNNING | HALTED | ROLLING_BACK -> PENDING   (requeued with attempt + 1)

Every non-terminal state may also go to FAILED or CANCELLED.
"""

from __future__ import annotations

from vigil_common.errors import Conflict
from vigil_common.events import TERMINAL_STATES

PENDING = "PENDING"
SCHEDULED = "SCHEDULED"
RUNNING = "RUNNING"
HALTED = "HALTED"
ROLLING_BACK = "ROLLING_BACK"
SUCCEEDED = "SUCCEEDED"
FAILED = "FAILED"
CANCELLED = "CANCELLED"

ALL_STATES: tuple[str, ...] = (
    PENDING,
    SCHEDULED,
    RUNNING,
    HALTED,
    ROLLING_BACK,
    SUCCEEDED,
    FAILED,
    CANCELLED,
)
_ENDS = {FAILED, CANCELLED}

TRANSITIONS: dict[str, frozenset[str]] = {
    PENDING: frozenset({SCHEDULED} | _ENDS),
    # HALTED / ROLLING_BACK from SCHEDULED: a guardian command may overtake the last RankStarted.
    SCHEDULED: frozenset({RUNNING, HALTED, ROLLING_BACK, PENDING, SUCCEEDED} | _ENDS),
    RUNNING: frozenset({HALTED, ROLLING_BACK, PENDING, SUCCEEDED} | _ENDS),
    HALTED: frozenset({ROLLING_BACK, RUNNING, PENDING} | _ENDS),
    ROLLING_BACK: frozenset({RUNNING, SCHEDULED, HALTED, PENDING} | _ENDS),
    SUCCEEDED: frozenset(),
    FAILED: frozenset(),
    CANCELLED: frozenset(),
}

# States in which a job owns its devices. Every other state (queued or terminal) owns none.
HOLDS_DEVICES: frozenset[str] = frozenset({SCHEDULED, RUNNING, HALTED, ROLLING_BACK})


def allowed(from_state: str, to_state: str) -> bool:
    return to_state in TRANSITIONS[from_state]


def check(job_id: str, from_state: str, to_state: str) -> None:
    """Raise Conflict when the job cannot go from `from_state` to `to_state`."""
    if not allowed(from_state, to_state):
        if from_state in TERMINAL_STATES:
            raise Conflict(f"job {job_id} is already {from_state}; it cannot become {to_state}")
        raise Conflict(f"job {job_id} cannot go from {from_state} to {to_state}")


def is_terminal(state: str) -> bool:
    return state in TERMINAL_STATES


def holds_devices(state: str) -> bool:
    return state in HOLDS_DEVICES
