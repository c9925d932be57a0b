"""Alert routes' pure parts: the filter, the three formats, the retry schedule."""

from __future__ import annotations

import json
from datetime import UTC, datetime

import pytest
from pydantic import ValidationError

from vigil.api_alerts import AlertFilter, AlertRouteIn
from vigil.events import IncidentRaised
from vigil_telemetry.alerts import formats
from vigil_telemetry.alerts.delivery import backoff_s, classify
from vigil_telemetry.alerts.match import wanted

AT = datetime(2026, 11, 29, 1, 0, tzinfo=UTC)
CTX = formats.Context(team="ml", console_url="https://vigil.example/")


def incident(kind: str = "nan", action: str = "rollback", job: str | None = "j-1") -> IncidentRaised:
    return IncidentRaised(
        job_id=job, attempt=1, kind=kind, action=action, step=40, rank=1, node="n1",
        message="loss is NaN on rank 1", evidence={"loss": "nan"}, occurred_at=AT,
    )  # fmt: skip


@pytest.mark.parametrize(
    ("f", "team", "passes"),
    [
        (AlertFilter(), None, True),
        (AlertFilter(kinds=["nan", "spike"]), None, True),
        (AlertFilter(kinds=["hang"]), None, False),
        (AlertFilter(actions=["halt"]), None, False),
        (AlertFilter(jobs=["j-1"], actions=["rollback"]), None, True),
        (AlertFilter(jobs=["j-2"]), None, False),
        (AlertFilter(teams=["ml"]), "ml", True),
        (AlertFilter(teams=["ml"]), None, False),
        (AlertFilter(min_severity="error"), None, True),
        (AlertFilter(min_severity="critical"), None, False),
    ],
)
def test_the_filter(f, team, passes):
    assert wanted(f, incident(), team) is passes


def test_a_bad_route_names_its_field():
    cases = {
        "format": {"name": "x", "url": "https://h.example/", "format": "xml"},
        "url": {"name": "x", "url": "ftp://h.example/"},
        "filter.kinds.0": {"name": "x", "url": "https://h.example/", "filter": {"kinds": ["meteor"]}},
    }
    for field, data in cases.items():
        with pytest.raises(ValidationError) as exc:
            AlertRouteIn.model_validate(data)
        assert [".".join(map(str, e["loc"])) for e in exc.value.errors()] == [field]
    for url in ("http://h.example:99999/", "https:///path", "https://h.example/a b"):
        with pytest.raises(ValidationError):
            AlertRouteIn(name="x", url=url)


def test_json_is_the_incident_itself():
    raised = incident()
    assert IncidentRaised.model_validate_json(formats.body("json", raised, CTX)) == raised
    assert formats.target("json", "https://h.example/hook") == "https://h.example/hook"


def test_slack_blocks_carry_the_incident_its_evidence_and_the_console_link():
    msg = json.loads(formats.body("slack", incident(), CTX))
    text = json.dumps(msg)
    assert msg["blocks"][0]["type"] == "header" and "nan" in msg["blocks"][0]["text"]["text"]
    assert "loss is NaN on rank 1" in msg["text"]
    assert '\\"loss\\": \\"nan\\"' in text  # the evidence, in a code block
    assert msg["blocks"][4]["elements"][0]["url"] == "https://vigil.example/jobs/j-1"
    assert "*Severity*\\nerror" in text and "*Team*\\nml" in text


def test_alertmanager_labels_annotations_and_resolution():
    assert formats.target("alertmanager", "http://am:9093/") == "http://am:9093/api/v2/alerts"
    raised = incident()
    firing = formats.body("alertmanager", raised, CTX)
    (alert,) = json.loads(firing)
    assert alert["labels"] == {
        "alertname": "VigilIncident", "job": "j-1", "kind": "nan", "severity": "error", "team": "ml"
    }  # fmt: skip
    assert alert["annotations"]["console"] == "https://vigil.example/jobs/j-1"
    assert (
        alert["annotations"]["incident"] == raised.event_id and alert["annotations"]["action"] == "rollback"
    )
    assert alert["startsAt"] == AT.isoformat() and "endsAt" not in alert
    (done,) = json.loads(formats.resolved(firing, AT.replace(hour=2)))
    assert done["labels"] == alert["labels"] and done["endsAt"] == AT.replace(hour=2).isoformat()
    (no_team,) = formats.alertmanager(incident(), formats.Context(team=None, console_url="http://c"))
    assert "team" not in no_team["labels"]


def test_retries_back_off_and_a_refusal_is_final():
    assert [backoff_s(n, 1.0, 5.0) for n in (1, 2, 3, 4)] == [1.0, 2.0, 4.0, 5.0]
    assert classify(204).error is None
    assert classify(500) == classify(500) and not classify(500).final and not classify(429).final
    assert classify(404).final and classify(404).error == "HTTP 404"
