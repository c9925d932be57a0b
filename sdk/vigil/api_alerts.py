"""The HTTP shapes of alert routes (`/api/v1/alerts/routes`): what a route is made of, what the gateway
answers, and a route's delivery log. One definition for the gateway and `vigil.Client`, as in `vigil.api`.

A route sends the incidents that pass its filter to its URL in its format: `json` (the incident, signed:
`vigil.alerts.verify`), `slack` (incoming-webhook blocks) or `alertmanager` (POSTed to `<url>/api/v2/alerts`,
resolved when the job runs again or succeeds). Every field of the filter that is empty lets everything
through; the fields combine with AND, the values of one field with OR.
"""

from __future__ import annotations

from datetime import datetime
from typing import Annotated, Literal, get_args
from urllib.parse import urlsplit

import httpx
from pydantic import BaseModel, ConfigDict, Field, StringConstraints, field_validator

from vigil.alerts import Severity
from vigil.api import Out
from vigil.events import IncidentAction, IncidentKind

AlertFormat = Literal["json", "slack", "alertmanager"]
FORMATS: tuple[AlertFormat, ...] = get_args(AlertFormat)
DeliveryStatus = Literal["pending", "delivered", "failed"]
DeliveryPhase = Literal["firing", "resolved"]
ROUTE_ID = r"^r-[0-9a-f]{16}$"
MAX_URL = 2048
_JOB_ID = r"^[A-Za-z0-9][A-Za-z0-9._:-]{0,127}$"
_NAME = r"^[a-z0-9][a-z0-9._-]{0,62}$"  # a team's name (the gateway's NAME_PATTERN)

JobIdItem = Annotated[str, StringConstraints(pattern=_JOB_ID)]
TeamItem = Annotated[str, StringConstraints(pattern=_NAME)]


class AlertFilter(BaseModel):
    """Which incidents a route sends. Empty lists: any; a route also sends only the incidents of jobs its
    owner sees (their own, their team's; an admin's, every job's)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    kinds: list[IncidentKind] = Field(default_factory=list, max_length=64, description="incident kinds")
    actions: list[IncidentAction] = Field(default_factory=list, max_length=16, description="what was done")
    jobs: list[JobIdItem] = Field(default_factory=list, max_length=256, description="job ids")
    teams: list[TeamItem] = Field(default_factory=list, max_length=256, description="the jobs' teams")
    min_severity: Severity = Field(
        default="info", description="info < warning < error < critical (`vigil.alerts.severity`)"
    )


class AlertRouteIn(BaseModel):
    """`POST /api/v1/alerts/routes`: a new route, the caller's (or, with `team`, their team's)."""

    model_config = ConfigDict(extra="forbid")

    name: str = Field(min_length=1, max_length=100, pattern=r"^[^\x00-\x1f]+$", description="a label")
    url: str = Field(
        max_length=MAX_URL,
        description="http(s) URL: the webhook, or Alertmanager's base URL",
        json_schema_extra={"pattern": r"^https?://[A-Za-z0-9.-]+(:[0-9]{1,5})?(/[!-~]*)?$"},
    )
    format: AlertFormat = "json"
    team: TeamItem | None = Field(None, description="owned by this team (the caller's) instead of the caller")
    filter: AlertFilter = Field(default_factory=AlertFilter)

    @field_validator("url")
    @classmethod
    def _http_url(cls, url: str) -> str:
        try:
            parts = urlsplit(url)
            port = parts.port  # raises ValueError for a port out of range
        except ValueError as exc:
            raise ValueError(f"not a URL: {exc}") from None
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError("must be an http:// or https:// URL with a host, e.g. https://hooks.example/x")
        if any(c.isspace() or ord(c) < 0x20 or ord(c) == 0x7F for c in url):
            raise ValueError("must hold no whitespace or control characters")
        try:
            httpx.URL(url)  # what delivers it must take it too
        except httpx.InvalidURL as exc:
            raise ValueError(f"not a URL: {exc}") from None
        del port
        return url


class AlertRouteOut(Out):
    id: str
    name: str
    url: str
    format: AlertFormat
    owner: str
    team: str | None = None  # set: the team's route, which everyone in it sees and deletes
    filter: AlertFilter
    created_at: datetime


class AlertRouteCreated(AlertRouteOut):
    """The answer to a new route: a `json` route's signing secret is in it, and never shown again."""

    secret: str | None = None


class AlertRouteList(Out):
    items: list[AlertRouteOut]
    next: str | None = None


class AlertDeliveryOut(Out):
    """One POST a route owes or made: for an incident (`firing`), or its end (`resolved`, alertmanager)."""

    id: int
    incident_id: str
    job_id: str | None = None
    kind: str
    phase: DeliveryPhase
    status: DeliveryStatus
    attempts: int
    last_error: str | None = None
    created_at: datetime
    updated_at: datetime
    next_at: datetime | None = None  # the next attempt (pending)
    delivered_at: datetime | None = None


class AlertDeliveryList(Out):
    items: list[AlertDeliveryOut]
    next: str | None = None
