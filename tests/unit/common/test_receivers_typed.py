"""Each message union's receivers `match` on it with `assert_never` in the default branch, so that an
event added to a union and handled by none of them is a type error: mypy checks the receivers (the
configuration is pyproject.toml's `[tool.mypy]`), and that the check bites in that configuration (a union's
members resolve to their classes, not to `Any`, which would let every `match` pass)."""

from __future__ import annotations

from pathlib import Path

import pytest

mypy_api = pytest.importorskip("mypy.api", reason="mypy is a test dependency (pyproject.toml)")

ROOT = Path(__file__).resolve().parents[3]
RECEIVERS = [
    "sdk/vigil/events.py",  # the unions and their guards
    "sdk/vigil/recovery.py",  # a rank's `act`: RankCommand
    "services/scheduler/vigil_scheduler/handlers.py",  # StatusEvent, JobCommand, IncidentAction
    "services/guardian/vigil_guardian/core.py",  # GuardianInput
    "services/guardian/vigil_guardian/watch.py",  # StatusEvent, IncidentAction
    "services/telemetry/vigil_telemetry/metrics.py",  # TelemetryInput
]

# A receiver of StatusEvent that forgot RestartRequested, and one of IncidentAction that forgot restart.
FORGETFUL = """
from typing import assert_never

from vigil.events import (
    CheckpointRefused, CheckpointSaved, DeviceDiagnosed, GuardianSettingsChanged, IncidentRaised,
    JobStateChanged, OutOfMemoryHalted, RankExited, RanksHalted, RankStarted, ReportRefused, RollbackCompleted, StacksDumped, StatusEvent,
    StepReplayed,
)


def status(event: StatusEvent) -> None:
    match event:
        case (
            RankStarted() | RankExited() | CheckpointSaved() | RanksHalted() | RollbackCompleted()
            | OutOfMemoryHalted() | StepReplayed() | ReportRefused() | CheckpointRefused()
            | DeviceDiagnosed() | StacksDumped() | JobStateChanged() | GuardianSettingsChanged()
        ):
            pass
        case _:
            assert_never(event)


def action(incident: IncidentRaised) -> None:
    match incident.action:
        case "alert" | "halt" | "rollback" | "fail" | "replay" | "skip":
            pass
        case _:
            assert_never(incident.action)
"""


@pytest.fixture(scope="module")
def mypy(tmp_path_factory):
    """mypy as CI runs it, from the repository (the configuration's mypy_path is relative to it), with
    one cache for the module's tests (the first run reads pydantic and the standard library's stubs)."""
    cache = tmp_path_factory.mktemp("mypy-cache")

    def run(*paths: str) -> tuple[str, int]:
        with pytest.MonkeyPatch.context() as mp:
            mp.chdir(ROOT)
            out, err, code = mypy_api.run(
                ["--config-file", str(ROOT / "pyproject.toml"), "--cache-dir", str(cache), *paths]
            )
        return out + err, code

    return run


def test_the_receivers_handle_every_member_of_their_unions(mypy):
    out, code = mypy(*RECEIVERS)
    assert code == 0, out


def test_a_receiver_that_forgets_a_member_is_a_type_error(mypy, tmp_path):
    probe = tmp_path / "forgetful.py"
    probe.write_text(FORGETFUL)
    out, code = mypy(str(probe))
    assert code == 1, out
    assert 'incompatible type "RestartRequested"; expected "Never"' in out, out
    assert 'incompatible type "Literal[\'restart\']"; expected "Never"' in out, out
