"""Job states: one enum, and everything that lists states (the migrations, the state machine, the
CLI's colours, the wire) agrees with it, so a state added in one place alone fails here."""

from __future__ import annotations

import json
import re

from vigil.events import JobStateChanged
from vigil.jobstates import DEVICE_STATES, TERMINAL_STATES, JobState
from vigil_cli.jobs import STATE_STYLE
from vigil_common.db import load_migrations
from vigil_scheduler.states import TRANSITIONS, allowed

_STATE_CHECK = re.compile(r"CHECK \((\w*state) IN \(([^)]*)\)\)")


def test_a_state_is_its_own_string() -> None:
    for state in JobState:
        # name == value keeps a member's hash equal to its string's, so a plain "RUNNING" from JSON
        # or SQL finds the member in TERMINAL_STATES and in tables keyed by JobState.
        assert state.name == state.value == str(state) == f"{state}"
    assert "SUCCEEDED" in TERMINAL_STATES and STATE_STYLE.get("RUNNING") == STATE_STYLE[JobState.RUNNING]


def test_terminal_and_device_holding_states_are_apart() -> None:
    assert not TERMINAL_STATES & DEVICE_STATES
    assert set(JobState) - TERMINAL_STATES - DEVICE_STATES == {JobState.PENDING}


def test_every_list_of_states_is_the_enum() -> None:
    assert set(TRANSITIONS) == set(JobState)
    assert all(not TRANSITIONS[s] for s in TERMINAL_STATES)
    assert set(STATE_STYLE) == set(JobState)


def test_the_migrations_check_the_enum_on_every_state_column() -> None:
    checked: dict[str, set[str]] = {}  # column -> its newest list (a later migration replaces it)
    for migration in load_migrations():
        for column, values in _STATE_CHECK.findall(migration.sql):
            checked[column] = set(re.findall(r"'([A-Z_]+)'", values))
    assert set(checked) == {"state", "from_state", "to_state"}
    for column, values in checked.items():
        assert values == {s.value for s in JobState}, column


def test_the_wire_carries_plain_strings() -> None:
    event = JobStateChanged(job_id="j-1", from_state="PENDING", to_state=JobState.SCHEDULED, cause="placed")
    raw = json.loads(event.to_bytes())
    assert raw["from_state"] == "PENDING" and raw["to_state"] == "SCHEDULED"
    schema = JobStateChanged.model_json_schema()
    assert set(schema["$defs"]["JobState"]["enum"]) == {s.value for s in JobState}


def test_a_restart_may_come_during_an_in_place_rollback():
    """Ranks whose program cannot load in place answer a rollback with RestartRequested; the scheduler
    may still be ROLLING_BACK (their halt not reported yet): the next attempt starts from there."""
    assert allowed(JobState.ROLLING_BACK, JobState.ROLLING_BACK)
    assert not allowed(JobState.RUNNING, JobState.RUNNING)
