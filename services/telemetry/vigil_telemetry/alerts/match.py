"""Which incidents a route wants, pure: its filter against one incident and its job's team. Whether the
route's owner may see the job at all is asked of the database (`outbox`, with `visibility.sees`)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from vigil.alerts import at_least, severity
from vigil.api_alerts import AlertFilter, AlertFormat
from vigil.events import IncidentRaised


@dataclass(frozen=True, slots=True)
class Route:
    id: str
    url: str
    format: AlertFormat
    owner: str
    team: str | None  # the route's team (a team's route)
    admin: bool  # made by an admin: every job's incidents
    viewer_team: str | None  # the team whose jobs it hears: its own, else its owner's
    filter: AlertFilter
    secret: str | None = None

    @classmethod
    def from_row(cls, row: Any) -> Route:
        raw = row["filter"]
        return cls(
            id=row["id"],
            url=row["url"],
            format=row["format"],
            owner=row["owner"],
            team=row["team"],
            admin=row["admin"],
            viewer_team=row["team"] or row["owner_team"],
            filter=AlertFilter.model_validate(json.loads(raw) if isinstance(raw, str) else raw),
        )


def wanted(f: AlertFilter, incident: IncidentRaised, job_team: str | None) -> bool:
    """Whether `incident` (of a job in `job_team`) passes filter `f`: every non-empty field must hold."""
    if f.kinds and incident.kind not in f.kinds:
        return False
    if f.actions and incident.action not in f.actions:
        return False
    if f.jobs and incident.job_id not in f.jobs:
        return False
    if f.teams and job_team not in f.teams:
        return False
    return at_least(severity(incident.kind, incident.action), f.min_severity)
