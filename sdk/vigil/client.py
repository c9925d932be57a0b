"""The HTTP API from Python: what the `vigil` CLI uses, and what scripts and notebooks use.

    import vigil

    with vigil.Client("http://127.0.0.1:8000", token) as client:
        job = client.submit("job.yaml")            # a path, YAML or JSON text, or a dict
        final = client.wait(job.id, on_event=print)  # JobStateChanged and IncidentRaised as they happen
        for row in client.steps(job.id, aggregate=True).items:
            ...

`vigil.Client.from_env()` finds the gateway and token as the CLI does: VIGIL_API_URL (else
VIGIL_HTTP_HOST:VIGIL_HTTP_PORT), and VIGIL_API_TOKEN (else the token file `vigil up` writes in the
data dir). Every answer is one of the API's models (`vigil.api`); every failure is a `VigilError`
carrying the HTTP status and, for a bad spec or parameter, the fields the gateway named.
"""

from __future__ import annotations

import json
import os
import time
import uuid
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import httpx
from httpx_sse import SSEError, connect_sse
from pydantic import TypeAdapter, ValidationError

from vigil import codepack, documents
from vigil.api import (
    ControlPlaneOut,
    DeviceMarkCleared,
    ErrorOut,
    FieldErrorOut,
    GpuPage,
    JobDetailOut,
    JobOut,
    JobPage,
    NodePage,
    Page,
    PrincipalOut,
    QueueOut,
    RevokedOut,
    TeamList,
    TeamOut,
    TokenOut,
    UserList,
    UserOut,
)
from vigil.api_alerts import AlertDeliveryList, AlertRouteCreated, AlertRouteIn, AlertRouteList, AlertRouteOut
from vigil.api_code import CodePackOut
from vigil.api_guardian import GuardianSettingsOut
from vigil.events import IncidentRaised, IncidentRaisedV1, JobStateChanged
from vigil.jobstates import TERMINAL_STATES

Event = JobStateChanged | IncidentRaised
# an older gateway's incidents are v1: read, and upgraded as the bus's decoder upgrades them
_EVENT: TypeAdapter[Event | IncidentRaisedV1] = TypeAdapter(Event | IncidentRaisedV1)
_EVENT_KINDS = ("job.state_changed", "incident.raised")
_GATEWAY_AWAY = (502, 503, 504)  # a proxy's answer while the gateway restarts or fails over
Spec = Mapping[str, Any] | str | bytes | Path


class VigilError(Exception):
    """The gateway refused a request (`status`, its `message` and the `fields` it named) or could not be
    reached (`status` None)."""

    def __init__(self, message: str, *, status: int | None = None, fields: list[FieldErrorOut] | None = None):
        self.status = status
        self.message = message
        self.fields = list(fields or [])
        super().__init__(str(self))

    def __str__(self) -> str:
        head = self.message if self.status is None else f"HTTP {self.status}: {self.message}"
        return "\n".join([head, *(f"  {f.field}: {f.message}" for f in self.fields)])

    @classmethod
    def of(cls, response: httpx.Response) -> VigilError:
        try:
            body = ErrorOut.model_validate_json(response.content)
        except ValidationError:
            return cls(response.text[:500] or response.reason_phrase, status=response.status_code)
        return cls(body.message, status=response.status_code, fields=body.fields)


class Client:
    """A synchronous client of one gateway, with one bearer token. Thread-safe (one httpx pool)."""

    def __init__(
        self,
        url: str,
        token: str,
        *,
        timeout_s: float = 30.0,
        transport: httpx.BaseTransport | None = None,
    ) -> None:
        self.url = url.rstrip("/")
        self._http = httpx.Client(
            base_url=self.url,
            headers={"Authorization": f"Bearer {token}"},
            timeout=timeout_s,
            transport=transport,
        )

    @classmethod
    def from_env(cls, url: str | None = None, **kw: Any) -> Client:
        """The gateway and token the CLI would use on this machine (see the module's docstring)."""

        from vigil.access import client_token, gateway_url

        return cls(url or gateway_url(os.environ), client_token(os.environ), **kw)

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # --- jobs ---------------------------------------------------------------------------------------

    def submit(
        self,
        spec: Spec,
        *,
        code: str | Path | None = None,
        idempotency_key: str | None = None,
        retry_for_s: float = 30.0,
    ) -> JobOut:
        """Submit a job spec: a path to a YAML or JSON file, YAML or JSON text, or a mapping.

        `code`: a folder of the job's own program, packed (`vigil.codepack`: `.gitignore` and
        `.vigilignore` honoured, at most VIGIL_CODE_MAX_MB) and uploaded first; the spec's
        `entrypoint.code` is set to the pack's SHA-256, and every attempt runs a copy of it.

        Safe to retry: the submit carries an `Idempotency-Key` (`idempotency_key`, else a new random
        one), and a submit cut off before its answer (the connection lost after sending, or 502-504
        while a scheduler fails over) is sent again with the same key for up to `retry_for_s`
        seconds: the gateway returns the job the first one made, never a second job. A gateway that
        refuses the first connection is an error at once."""
        if code is not None:
            spec, kind, body = self._with_code(spec, Path(code))
        elif isinstance(spec, Path):
            kind = "application/json" if spec.suffix.lower() == ".json" else "application/yaml"
            body = spec.read_bytes()
        elif isinstance(spec, Mapping):
            kind, body = "application/json", json.dumps(spec).encode()
        else:  # YAML text (JSON is YAML too)
            kind, body = "application/yaml", spec.encode() if isinstance(spec, str) else spec
        headers = {"Content-Type": kind, "Idempotency-Key": idempotency_key or uuid.uuid4().hex}
        deadline, wait_s, sent = time.monotonic() + retry_for_s, 0.25, False
        while True:
            try:
                answer = self._call("POST", "/api/v1/jobs", content=body, headers=headers)
            except VigilError as exc:
                refused = isinstance(exc.__cause__, httpx.ConnectError)  # nothing was sent
                sent = sent or not refused
                if (
                    exc.status not in (None, 502, 503, 504)
                    or not sent  # no gateway there at all: say so now, do not wait
                    or time.monotonic() + wait_s > deadline
                ):
                    raise
                time.sleep(wait_s)  # back-off before sending the same submit again
                wait_s = min(wait_s * 2, 4.0)
                continue
            return JobOut.model_validate(answer)

    def upload_code(self, folder: str | Path) -> CodePackOut:
        """`folder` packed (`vigil.codepack.pack`, VIGIL_CODE_MAX_MB from this environment) and uploaded;
        the gateway keeps it by its SHA-256 (the same bytes once). PackRefused naming the entry that
        cannot be packed, or the largest files past the limit."""

        pack = codepack.pack(folder, max_mb=codepack.max_mb_from(os.environ))
        headers = {"Content-Type": "application/octet-stream"}  # a gzipped tar
        return CodePackOut.model_validate(
            self._call("POST", "/api/v1/code", content=pack.data, headers=headers)
        )

    def code(self, job_id: str) -> bytes:
        """The code package job `job_id` runs (a gzipped tar), as it was uploaded (checked by its hash)."""
        try:
            r = self._http.get(f"/api/v1/jobs/{_segment(job_id)}/code")
        except httpx.TransportError as exc:
            raise VigilError(f"cannot reach the gateway at {self.url} ({exc})") from exc
        if r.status_code >= 400:
            raise VigilError.of(r)
        named = r.headers.get("X-Vigil-Code-Sha256")
        if named is not None and codepack.digest(r.content) != named:
            raise VigilError(f"the code package of {job_id} came back damaged: its hash is not {named}")
        return r.content

    def _with_code(self, spec: Spec, folder: Path) -> tuple[Spec, str, bytes]:
        """`spec` (as JSON) naming the pack of `folder` in `entrypoint.code`, once uploaded."""
        if isinstance(spec, Path):
            found = documents.load(spec.read_text())
        elif isinstance(spec, Mapping):
            found = json.loads(json.dumps(spec))
        else:
            found = documents.load(spec.decode() if isinstance(spec, bytes) else spec)
        if not isinstance(found, dict) or not isinstance(found.get("entrypoint"), dict):
            raise VigilError("--code needs a spec with an entrypoint (the program to run from the folder)")
        found["entrypoint"]["code"] = self.upload_code(folder).sha256
        return found, "application/json", json.dumps(found).encode()

    def jobs(self, state: str | None = None, *, limit: int = 50, cursor: str | None = None) -> JobPage:
        """A page of jobs, newest first; `page.next` is the cursor of the next page."""
        params = _params(state=state.upper() if state else None, limit=limit, cursor=cursor)
        return JobPage.model_validate(self._call("GET", "/api/v1/jobs", params=params))

    def job(self, job_id: str) -> JobDetailOut:
        """One job with its transitions, attempts and the ranks of its current attempt."""
        return JobDetailOut.model_validate(self._call("GET", f"/api/v1/jobs/{_segment(job_id)}"))

    def queue(self) -> QueueOut:
        """The queued jobs in queue order, each with its position, why it waits and its estimated start,
        and the teams' fair-share standings."""
        return QueueOut.model_validate(self._call("GET", "/api/v1/queue"))

    def cancel(self, job_id: str) -> JobOut:
        return JobOut.model_validate(self._call("POST", f"/api/v1/jobs/{_segment(job_id)}/cancel"))

    def set_guardian(self, job_id: str, **fields: Any) -> GuardianSettingsOut:
        """Change a queued or running job's guardian settings (fields of the spec's `guardian:` section,
        `spike_zscore=4.0`); the guardian applies them from the next step it judges."""
        path = f"/api/v1/jobs/{_segment(job_id)}/guardian"
        return GuardianSettingsOut.model_validate(self._call("PATCH", path, json=fields))

    def steps(
        self,
        job_id: str,
        *,
        rank: int | None = None,
        attempt: int | None = None,
        aggregate: bool = False,
        limit: int = 100,
        cursor: str | None = None,
    ) -> Page:
        """Step metrics, per rank, or one row per step with `aggregate=True`."""
        params = _params(rank=rank, attempt=attempt, aggregate=aggregate or None, limit=limit, cursor=cursor)
        return Page.model_validate(self._call("GET", f"/api/v1/jobs/{_segment(job_id)}/steps", params=params))

    def checkpoints(self, job_id: str, *, limit: int = 100, cursor: str | None = None) -> Page:
        params = _params(limit=limit, cursor=cursor)
        path = f"/api/v1/jobs/{_segment(job_id)}/checkpoints"
        return Page.model_validate(self._call("GET", path, params=params))

    def incidents(self, job_id: str | None = None, *, limit: int = 100, cursor: str | None = None) -> Page:
        """What the guardian saw and did: of one job, or of every job; newest first."""
        path = "/api/v1/incidents" if job_id is None else f"/api/v1/jobs/{_segment(job_id)}/incidents"
        return Page.model_validate(self._call("GET", path, params=_params(limit=limit, cursor=cursor)))

    def audit(self, job_id: str | None = None, *, limit: int = 100, cursor: str | None = None) -> Page:
        """Who asked for each submit, cancel, halt, rollback and resume; newest first."""
        params = _params(job_id=job_id, limit=limit, cursor=cursor)
        return Page.model_validate(self._call("GET", "/api/v1/audit", params=params))

    # --- inventory ----------------------------------------------------------------------------------

    def nodes(self, *, limit: int = 1000, cursor: str | None = None) -> NodePage:
        params = _params(limit=limit, cursor=cursor)
        return NodePage.model_validate(self._call("GET", "/api/v1/nodes", params=params))

    def gpus(self, *, limit: int = 1000, cursor: str | None = None) -> GpuPage:
        params = _params(limit=limit, cursor=cursor)
        return GpuPage.model_validate(self._call("GET", "/api/v1/gpus", params=params))

    def clear_device_mark(self, node: str, index: int) -> DeviceMarkCleared:
        """Clear a device's unhealthy mark (an admin's token; audited): placement offers it again."""
        path = f"/api/v1/gpus/{_segment(node)}/{int(index)}/clear"
        return DeviceMarkCleared.model_validate(self._call("POST", path))

    def control_plane(self) -> ControlPlaneOut:
        """Which scheduler and which guardian are active now (pid@host of each lock's holder)."""
        return ControlPlaneOut.model_validate(self._call("GET", "/api/v1/control-plane"))

    # --- users, tokens and quotas -------------------------------------------------------------------

    def me(self) -> PrincipalOut:
        """Who this client's token stands for."""
        return PrincipalOut.model_validate(self._call("GET", "/api/v1/me"))

    def users(self) -> UserList:
        """Every user (an admin's token only)."""
        return UserList.model_validate(self._call("GET", "/api/v1/users"))

    def put_user(
        self, name: str, *, team: str | None = None, admin: bool = False, gpus: int | None = None
    ) -> UserOut:
        """Create or update a user: its team, admin flag and GPU quota (None: no limit). Admin only."""
        body = {"team": team, "admin": admin, "gpus": gpus}
        return UserOut.model_validate(self._call("PUT", f"/api/v1/users/{_segment(name)}", json=body))

    def issue_token(self, name: str) -> TokenOut:
        """A new token for the user, shown this once (only its hash is kept). Admin only."""
        return TokenOut.model_validate(self._call("POST", f"/api/v1/users/{_segment(name)}/tokens"))

    def revoke_tokens(self, name: str) -> RevokedOut:
        """Revoke every token of the user. Admin only."""
        return RevokedOut.model_validate(self._call("DELETE", f"/api/v1/users/{_segment(name)}/tokens"))

    def teams(self) -> TeamList:
        return TeamList.model_validate(self._call("GET", "/api/v1/teams"))

    def put_team(self, name: str, *, gpus: int | None) -> TeamOut:
        """Set a team's GPU quota (None: no limit). Admin only."""
        return TeamOut.model_validate(
            self._call("PUT", f"/api/v1/teams/{_segment(name)}", json={"gpus": gpus})
        )

    def set_share(self, name: str, share: float) -> TeamOut:
        """Set a team's weight in the fair share (> 0; 1 unless set). Admin only."""
        return TeamOut.model_validate(
            self._call("PUT", f"/api/v1/teams/{_segment(name)}/share", json={"share": share})
        )

    # --- alert routes -------------------------------------------------------------------------------

    def alert_routes(self) -> AlertRouteList:
        """The alert routes this token sees: its own and its team's (an admin: every one)."""
        return AlertRouteList.model_validate(self._call("GET", "/api/v1/alerts/routes"))

    def add_alert_route(self, route: AlertRouteIn | Mapping[str, Any]) -> AlertRouteCreated:
        """A new route (`vigil.api_alerts.AlertRouteIn`); a `json` route's secret is in the answer, once."""
        body = route.model_dump(mode="json") if isinstance(route, AlertRouteIn) else dict(route)
        return AlertRouteCreated.model_validate(self._call("POST", "/api/v1/alerts/routes", json=body))

    def remove_alert_route(self, route_id: str) -> AlertRouteOut:
        return AlertRouteOut.model_validate(
            self._call("DELETE", f"/api/v1/alerts/routes/{_segment(route_id)}")
        )

    def alert_deliveries(self, route_id: str, *, limit: int = 100) -> AlertDeliveryList:
        """A route's delivery log, newest first."""
        path = f"/api/v1/alerts/routes/{_segment(route_id)}/deliveries"
        return AlertDeliveryList.model_validate(self._call("GET", path, params={"limit": limit}))

    # --- live events --------------------------------------------------------------------------------

    def events(
        self,
        job_id: str | None = None,
        *,
        on_connect: Callable[[], None] | None = None,
        reconnect_for_s: float = 60.0,
    ) -> Iterator[Event]:
        """Job state changes and incidents as they are published (of one job, or all), until the caller
        stops iterating. `on_connect` runs each time the subscription holds: every change from then on is
        yielded (what `wait` uses to not miss an ending).

        The stream is read as server-sent events (`httpx-sse`): comments and keep-alives are skipped, and
        a stream that is cut or closed is opened again after the gateway's `retry` delay with the last
        event's id in `Last-Event-ID`, so each event is yielded once and none is lost. A gateway that
        cannot be reached again within `reconnect_for_s` seconds is a VigilError."""
        params = _params(job=job_id)
        last_id = ""
        retry_s = 1.0
        lost_since: float | None = None  # since when the stream has been down (None while it is up)
        while True:
            headers = {"Last-Event-ID": last_id} if last_id else {}
            why: object = "the gateway closed the stream"
            try:
                with connect_sse(
                    self._http, "GET", "/api/v1/events", params=params, headers=headers, timeout=None
                ) as source:
                    answer = source.response
                    if answer.status_code == 204:  # the spec's "do not reconnect"
                        return
                    if answer.status_code >= 400:
                        answer.read()
                        if answer.status_code not in _GATEWAY_AWAY:
                            raise VigilError.of(answer)
                        why = VigilError.of(answer)
                    else:
                        for sse in source.iter_sse():
                            last_id = sse.id or last_id
                            if sse.retry is not None:
                                retry_s = sse.retry / 1000
                            if sse.event == "connected":
                                lost_since = None
                                if on_connect is not None:
                                    on_connect()
                            elif sse.event in _EVENT_KINDS:
                                yield _event(sse.event, sse.data)
            except SSEError as exc:
                raise VigilError(f"{self.url}/api/v1/events is not an event stream: {exc}") from exc
            except httpx.TransportError as exc:
                if not last_id and isinstance(exc, httpx.ConnectError):  # never reached: say so now
                    raise VigilError(f"cannot reach the gateway at {self.url} ({exc})") from exc
                why = exc
            now = time.monotonic()
            lost_since = now if lost_since is None else lost_since
            if now + retry_s - lost_since > reconnect_for_s:
                raise VigilError(f"lost the event stream from {self.url} for {reconnect_for_s:.0f}s: {why}")
            time.sleep(retry_s)  # the gateway's retry delay, before connecting again

    def wait(self, job_id: str, *, on_event: Callable[[Event], None] | None = None) -> JobDetailOut:
        """Follow a job until it ends (SUCCEEDED, FAILED or CANCELLED) and return it; `on_event` sees each
        state change and incident of the job on the way."""

        class _Ended(Exception):
            pass

        def check_ended() -> None:  # subscribed: an ending from now on reaches us; did it end before?
            if self.job(job_id).state in TERMINAL_STATES:
                raise _Ended

        try:
            for event in self.events(job_id, on_connect=check_ended):
                if on_event is not None:
                    on_event(event)
                if isinstance(event, JobStateChanged) and event.to_state in TERMINAL_STATES:
                    break
            else:
                raise VigilError(f"the event stream from {self.url} ended before job {job_id} did")
        except _Ended:
            pass
        return self.job(job_id)

    # --- one request --------------------------------------------------------------------------------

    def _call(self, method: str, path: str, **kw: Any) -> Any:
        try:
            r = self._http.request(method, path, **kw)
        except httpx.TransportError as exc:
            where = f"cannot reach the gateway at {self.url} ({exc})"
            raise VigilError(f"{where}: is `vigil up` running?") from exc
        if r.status_code >= 400:
            raise VigilError.of(r)
        return r.json()


def _event(kind: str, data: str) -> Event:
    try:
        event = _EVENT.validate_json(data)
    except ValidationError as exc:
        raise VigilError(f"the gateway sent a {kind} event that is not one: {exc}") from exc
    return event.upgraded() if isinstance(event, IncidentRaisedV1) else event


def _params(**given: Any) -> dict[str, Any]:
    return {k: v for k, v in given.items() if v is not None}


def _segment(job_id: str) -> str:
    """A job id as one path segment (an id with '/' or '?' in it asks for that job, not another path)."""
    from urllib.parse import quote

    return quote(job_id, safe="")
