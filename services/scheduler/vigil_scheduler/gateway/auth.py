"""Bearer-token auth for everything under /api/v1, compared in constant time (the token itself comes
from `vigil_common.token`)."""

from __future__ import annotations

import hmac
from typing import Any

from litestar.connection import ASGIConnection
from litestar.handlers.base import BaseRouteHandler

from vigil_scheduler import audit
from vigil_scheduler.gateway.errors import Unauthorized


def bearer_guard(connection: ASGIConnection, _: BaseRouteHandler) -> None:
    expected: str = connection.app.state.api_token
    header = connection.headers.get("authorization", "")
    scheme, _, given = header.partition(" ")
    if scheme.lower() != "bearer" or not given:
        raise Unauthorized("missing bearer token: send 'Authorization: Bearer <VIGIL_API_TOKEN>'")
    if not hmac.compare_digest(given.strip().encode(), expected.encode()):
        raise Unauthorized("invalid bearer token")


def admin_guard(connection: ASGIConnection, handler: BaseRouteHandler) -> None:
    """Routes that change the cluster itself (clearing a device's mark) take an admin's token. The API's
    one token (VIGIL_API_TOKEN) is the admin's: `bearer_guard` is that check."""
    bearer_guard(connection, handler)


def actor(connection: ASGIConnection[Any, Any, Any, Any]) -> str:
    """The caller as the audit record names it. Whoever passed a guard holds the app's token: the
    bearer header is the token, and a console session is opened only with it, so both are the token's
    fingerprint."""
    return audit.token_actor(connection.app.state.api_token)
