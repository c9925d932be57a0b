"""The console's login: the same bearer token as the API, exchanged once for an HttpOnly,
SameSite=Strict cookie. The cookie holds an HMAC of the token (never the token itself), so it is valid
exactly as long as the token is, and needs no session store."""

from __future__ import annotations

import hashlib
import hmac

from litestar import Request, Response
from litestar.connection import ASGIConnection
from litestar.exceptions import NotAuthorizedException
from litestar.handlers.base import BaseRouteHandler
from litestar.response import Redirect
from litestar.status_codes import HTTP_401_UNAUTHORIZED

COOKIE = "vigil_console"


class LoginRequired(NotAuthorizedException):
    """No valid console cookie (nor bearer token) on a console request."""


def session_value(token: str) -> str:
    return hmac.new(token.encode(), b"vigil-console-session-v1", hashlib.sha256).hexdigest()


def token_matches(given: str, token: str) -> bool:
    return hmac.compare_digest(given.strip().encode(), token.encode())


def console_guard(connection: ASGIConnection, _: BaseRouteHandler) -> None:
    """A page or its data needs the console cookie, or the API's bearer header (for scripts)."""
    token: str = connection.app.state.api_token
    cookie = connection.cookies.get(COOKIE, "")
    if cookie and hmac.compare_digest(cookie.encode(), session_value(token).encode()):
        return
    scheme, _, given = connection.headers.get("authorization", "").partition(" ")
    if scheme.lower() == "bearer" and given and token_matches(given, token):
        return
    raise LoginRequired("log in with the API token")


def login_required(request: Request, exc: LoginRequired) -> Response:
    """Pages send the browser to the login page; data and event streams answer 401."""
    path = request.url.path
    if path.startswith("/console/") or "text/html" not in request.headers.get("accept", ""):
        return Response(
            {"status": 401, "error": "Unauthorized", "message": str(exc.detail), "fields": []},
            status_code=HTTP_401_UNAUTHORIZED,
        )
    return Redirect(f"/login?next={safe_next(path)}")


def safe_next(path: str) -> str:
    """Only a local path may follow a login (no open redirect)."""
    return path if path.startswith("/") and not path.startswith("//") else "/"
