"""The console's login and its guard. The login takes an API token (the admin's or a user's) and opens a
session of its principal (`console.sessions`): an HttpOnly, SameSite=Strict cookie that expires
(VIGIL_CONSOLE_SESSION_S) and that logout revokes. Scripts may send the bearer header instead of the
cookie. Either way the guard puts the principal on the request: the pages show and act on the jobs it
may see, as the API does.

SameSite ignores ports, so any page on another local port is "same site": every request that changes
something (login, logout, submit, cancel) must therefore come from the console's own origin (its
`Origin` and `Sec-Fetch-Site` headers, when the browser sends them) and, with a cookie, carry the
session's CSRF token in its form; anything else is a 403 saying which check failed.
"""

from __future__ import annotations

import hmac
import math
import time
import urllib.parse
from collections.abc import Callable
from typing import Any

from litestar import Request, Response
from litestar.connection import ASGIConnection
from litestar.exceptions import NotAuthorizedException
from litestar.handlers.base import BaseRouteHandler
from litestar.response import Redirect
from litestar.status_codes import HTTP_401_UNAUTHORIZED

from vigil_common.settings import Settings
from vigil_scheduler.console.sessions import LoginThrottle, Session, Sessions
from vigil_scheduler.gateway.auth import bearer_token
from vigil_scheduler.gateway.errors import BadForm, Forbidden, Unauthorized
from vigil_scheduler.gateway.parsing import off_loop
from vigil_scheduler.users import Authenticator

COOKIE = "vigil_console"
CSRF_FIELD = "csrf"
SAFE_METHODS = frozenset({"GET", "HEAD", "OPTIONS"})
MAX_FORM_FIELDS = 16  # the console's forms have two or three


class LoginRequired(NotAuthorizedException):
    """No valid console cookie (nor bearer token) on a console request."""


class LoginRefused(Unauthorized):
    """A login that opened no session: the login page says why, with this status."""

    status_code = 401
    headers: dict[str, str] = {}


class TooManyLogins(LoginRefused):
    status_code = 429

    def __init__(self, address: str, wait_s: float) -> None:
        retry = math.ceil(wait_s)
        self.headers = {"Retry-After": str(retry)}
        super().__init__(f"too many failed logins from {address}: try again in {retry} s")


class ConsoleAuth:
    """The console's sessions and failed-login throttle (in this process's memory), and its guard."""

    def __init__(self, settings: Settings, clock: Callable[[], float] = time.monotonic) -> None:
        self.session_s = settings.console_session_s
        self.sessions = Sessions(settings.console_session_s)
        self.throttle = LoginThrottle()
        self.clock = clock

    async def login(self, address: str, given: str, authenticator: Authenticator) -> str:
        """A new session's cookie for the principal of token `given`; raises LoginRefused (a wrong
        token) or TooManyLogins (past the throttle, whichever token is given)."""
        wait_s = self.throttle.wait_s(address, self.clock())
        if wait_s > 0:
            raise TooManyLogins(address, wait_s)
        found = await authenticator.principal(given)
        now = self.clock()
        if found is None:
            self.throttle.failed(address, now)
            raise LoginRefused("wrong token")
        self.throttle.succeeded(address)
        cookie, _ = self.sessions.open(now, found)
        return cookie

    def session(self, connection: ASGIConnection[Any, Any, Any, Any]) -> Session | None:
        return self.sessions.get(connection.cookies.get(COOKIE, ""), self.clock())

    async def guard(self, connection: ASGIConnection[Any, Any, Any, Any], _: BaseRouteHandler) -> None:
        """A page or its data needs a live session's cookie, or the API's bearer header (for scripts);
        a write also needs the console's origin and, with a cookie, the session's CSRF token."""
        session = self.session(connection)
        given = bearer_token(connection)
        bearer = None if given is None else await connection.app.state.authenticator.principal(given)
        if bearer is None and (session is None or session.principal is None):
            raise LoginRequired("log in with an API token")
        connection.state.principal = bearer or session.principal  # type: ignore[union-attr]
        connection.state.csrf = session.csrf if session else ""  # the templates' forms send it back
        if connection.method in SAFE_METHODS:
            return
        check_origin(connection)
        if session is not None and bearer is None:  # a browser cannot add a bearer header cross-origin
            assert isinstance(connection, Request)
            given = (await read_form(connection)).get(CSRF_FIELD, "")
            if not hmac.compare_digest(given.encode(), session.csrf.encode()):
                raise Forbidden(
                    f"refused: the form's CSRF token (field {CSRF_FIELD!r}) is missing or not this "
                    "session's; reload the console's page and submit again"
                )


def check_origin(connection: ASGIConnection[Any, Any, Any, Any]) -> None:
    """Refuse a write that a browser says comes from another origin (another port counts)."""
    own = f"{connection.url.scheme}://{connection.headers.get('host', '')}".lower()
    origin = connection.headers.get("origin")
    if origin is not None and origin.lower() != own:
        raise Forbidden(
            f"refused: a cross-origin request (Origin {origin[:100]!r}, not this console's {own!r})"
        )
    fetch_site = connection.headers.get("sec-fetch-site")
    if fetch_site is not None and fetch_site not in ("same-origin", "none"):
        raise Forbidden(
            f"refused: a {fetch_site[:32]} request (Sec-Fetch-Site); only the console's own pages may write"
        )


async def read_form(request: Request[Any, Any, Any]) -> dict[str, str]:
    """The request's url-encoded form, parsed off the event loop once (the guard reads its CSRF token,
    the handler the rest)."""
    form: dict[str, str] | None = request.state.get("console_form")
    if form is None:
        form = await off_loop(request, parse_form, await request.body())
        request.state.console_form = form
    return form


def parse_form(body: bytes) -> dict[str, str]:
    """An `application/x-www-form-urlencoded` body as one string per field (a repeated field is refused)."""
    try:
        pairs = urllib.parse.parse_qsl(
            body.decode(), keep_blank_values=True, errors="strict", max_num_fields=MAX_FORM_FIELDS
        )
    except UnicodeDecodeError as exc:
        raise BadForm("(form)", f"the form is not UTF-8 text (byte {exc.start})") from exc
    except ValueError as exc:  # more fields than max_num_fields
        raise BadForm("(form)", f"a console form has at most {MAX_FORM_FIELDS} fields") from exc
    form: dict[str, str] = {}
    for name, value in pairs:
        if name in form:
            raise BadForm(name[:64], f"form field {name[:64]!r} is given more than once")
        form[name] = value
    return form


def login_required(request: Request[Any, Any, Any], exc: LoginRequired) -> Response[Any]:
    """Pages send the browser to the login page; data and event streams answer 401."""
    path = request.url.path
    if path.startswith("/console/") or "text/html" not in request.headers.get("accept", ""):
        return Response(
            {"status": 401, "error": "Unauthorized", "message": str(exc.detail), "fields": []},
            status_code=HTTP_401_UNAUTHORIZED,
        )
    return Redirect(f"/login?next={urllib.parse.quote(safe_next(path))}")


def safe_next(path: str) -> str:
    """Only a local path may follow a login (no open redirect: browsers read `/\\host` as `//host` and
    drop tabs and newlines, so neither may appear)."""
    local = path.startswith("/") and not path.startswith("//") and "\\" not in path
    return path if local and path.isprintable() and len(path) <= 2048 else "/"
