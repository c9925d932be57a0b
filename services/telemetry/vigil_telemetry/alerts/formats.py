"""What a route posts, pure: the body for each format, the URL it goes to, and an alert's resolution.

- `json`: the incident's own JSON (IncidentRaised), signed at each attempt (`delivery`).
- `slack`: an incoming webhook's message: a header, the incident's fields, its evidence, a console link.
- `alertmanager`: a list of one alert for Alertmanager's `POST /api/v2/alerts`, labelled alertname, job,
  kind, team, severity (one alert per job and kind: a repeat of the same incident is the same alert),
  resolved by the same alert with `endsAt`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from vigil.alerts import severity
from vigil.api_alerts import AlertFormat
from vigil.events import IncidentRaised

ALERTNAME = "VigilIncident"
ALERTMANAGER_PATH = "/api/v2/alerts"
_SLACK_TEXT = 2900  # a section's text is at most 3,000 characters
_ANNOTATION = 4000


@dataclass(frozen=True, slots=True)
class Context:
    """What an incident does not say: its job's team, and where the console is."""

    team: str | None
    console_url: str

    def link(self, job_id: str | None) -> str:
        base = self.console_url.rstrip("/")
        return f"{base}/jobs/{job_id}" if job_id else base + "/"


def target(fmt: AlertFormat, url: str) -> str:
    """Where a route's deliveries go: its URL, or the alerts endpoint below Alertmanager's base URL."""
    if fmt == "alertmanager" and not url.rstrip("/").endswith(ALERTMANAGER_PATH):
        return url.rstrip("/") + ALERTMANAGER_PATH
    return url


def body(fmt: AlertFormat, incident: IncidentRaised, ctx: Context) -> str:
    if fmt == "json":
        return incident.model_dump_json()
    if fmt == "slack":
        return json.dumps(slack(incident, ctx))
    return json.dumps(alertmanager(incident, ctx))


def _evidence(incident: IncidentRaised, limit: int) -> str:
    text = json.dumps(incident.evidence, indent=1, sort_keys=True, default=str)
    return text if len(text) <= limit else text[: limit - 1] + "…"


def _where(incident: IncidentRaised) -> str:
    parts = [f"step {incident.step}" if incident.step is not None else None]
    parts += [f"rank {incident.rank}" if incident.rank is not None else None]
    parts += [f"node {incident.node}" if incident.node else None]
    return ", ".join(p for p in parts if p) or "-"


def slack(incident: IncidentRaised, ctx: Context) -> dict[str, Any]:
    sev = severity(incident.kind, incident.action)
    title = f"{sev.upper()}: {incident.kind} on {incident.job_id or 'the cluster'} ({incident.action})"
    fields = {
        "Job": f"<{ctx.link(incident.job_id)}|{incident.job_id or '-'}>",
        "Team": ctx.team or "-",
        "Kind": incident.kind,
        "Action": incident.action,
        "Severity": sev,
        "Where": _where(incident),
    }
    return {
        "text": f"{title}: {incident.message}",
        "blocks": [
            {"type": "header", "text": {"type": "plain_text", "text": title[:150]}},
            {"type": "section", "text": {"type": "mrkdwn", "text": incident.message[:_SLACK_TEXT]}},
            {
                "type": "section",
                "fields": [{"type": "mrkdwn", "text": f"*{k}*\n{v}"} for k, v in fields.items()],
            },
            {
                "type": "section",
                "text": {
                    "type": "mrkdwn",
                    "text": "*Evidence*\n```" + _evidence(incident, _SLACK_TEXT) + "```",
                },
            },
            {
                "type": "actions",
                "elements": [
                    {
                        "type": "button",
                        "text": {"type": "plain_text", "text": "Open in the console"},
                        "url": ctx.link(incident.job_id),
                    }
                ],
            },
            {
                "type": "context",
                "elements": [
                    {
                        "type": "mrkdwn",
                        "text": f"incident {incident.event_id} · {incident.occurred_at.isoformat()}",
                    }
                ],
            },
        ],
    }


def alertmanager(incident: IncidentRaised, ctx: Context) -> list[dict[str, Any]]:
    labels = {
        "alertname": ALERTNAME,
        "job": incident.job_id or "",
        "kind": incident.kind,
        "severity": severity(incident.kind, incident.action),
    }
    if ctx.team:
        labels["team"] = ctx.team
    return [
        {
            "labels": {k: v for k, v in labels.items() if v},
            "annotations": {
                "summary": incident.message[:_ANNOTATION],
                "description": _evidence(incident, _ANNOTATION),
                "action": incident.action,
                "incident": incident.event_id,
                "where": _where(incident),
                "console": ctx.link(incident.job_id),
            },
            "startsAt": incident.occurred_at.isoformat(),
            "generatorURL": ctx.link(incident.job_id),
        }
    ]


def resolved(firing: str, at: datetime) -> str:
    """An alertmanager delivery's body as resolved at `at`: the same alerts, ending then."""
    alerts = json.loads(firing)
    return json.dumps([{**a, "endsAt": at.isoformat()} for a in alerts])
