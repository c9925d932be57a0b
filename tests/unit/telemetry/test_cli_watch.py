import json
from datetime import UTC, datetime

from vigil.events import GuardianSettingsChanged, IncidentRaised, JobStateChanged, RollbackCompleted
from vigil.spec import GuardianSpec
from vigil_cli.observe import format_json, format_line

T = datetime(2026, 1, 1, 12, 30, 5, 250000, tzinfo=UTC)


def test_readable_lines():
    inc = IncidentRaised(
        job_id="j-1",
        attempt=2,
        kind="nan",
        action="rollback",
        step=7,
        rank=1,
        node="n1",
        message="non-finite loss",
        occurred_at=T,
    )
    assert (
        format_line(inc)
        == "12:30:05.250  j-1#2  INCIDENT nan -> ROLLBACK  step 7 rank 1 on n1: non-finite loss"
    )
    st = JobStateChanged(
        job_id="j-1", attempt=2, from_state="RUNNING", to_state="HALTED", cause="nan", occurred_at=T
    )
    assert format_line(st) == "12:30:05.250  j-1#2  STATE    RUNNING -> HALTED  (nan)"
    rb = RollbackCompleted(
        job_id="j-1",
        attempt=2,
        from_step=8,
        to_step=5,
        checkpoint="/c/5",
        command_id="c",
        duration_s=1.5,
        node="n0",
        skip_data=(7, 8),
        occurred_at=T,
    )
    assert "ROLLBACK step 8 -> 5 in 1.50s, data 7..8 skipped" in format_line(rb)


def test_json_lines_are_the_events():
    inc = IncidentRaised(job_id="j-1", attempt=2, kind="hang", action="alert", message="m", occurred_at=T)
    assert json.loads(format_json(inc))["kind"] == "hang"
    assert "\n" not in format_json(inc)


def test_a_guardian_settings_change_reads_as_one_line():
    changed = GuardianSettingsChanged(
        job_id="j-1",
        attempt=2,
        revision=3,
        settings=GuardianSpec(spike_zscore=4.0),
        changed={"spike_zscore": 4.0},
        by="user:alice",
        occurred_at=T,
    )
    assert format_line(changed) == (
        "12:30:05.250  j-1#2  GUARDIAN settings revision 3 by user:alice: spike_zscore=4.0"
    )
