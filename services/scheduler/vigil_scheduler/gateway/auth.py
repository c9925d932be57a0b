"""Bearer-token auth for everything under /api/v1: the token names a principal (`users.Authenticator`:
the gateway's own token is the admin's, any other a user's), which the guard puts on the connection
for the handlers (`principal`) and the audit record (`actor`)."""

from __future__ import annotations

from typing import Any

from litestar.connection import ASGIConnection
from litestar.handlers.base import BaseRouteHandler

from vigil_scheduler.gateway.errors import Forbidden, Unauthorized
from vigil_scheduler.principals import Principal
from vigil_scheduler.users import Authenticator

Connection = ASGIConnection[Any, Any, Any, Any]


def bearer_token(connection: Connection) -> str | None:
    scheme, _, given = connection.headers.get("authorization", "").partition(" ")
    return given if scheme.lower() == "bearer" and given else None


async def bearer_guard(connection: Connection, _: BaseRouteHandler) -> None:
    given = bearer_token(connection)
    if given is None:
        raise Unauthorized("missing bearer token: send 'Authorization: Bearer <token>'")
    authenticator: Authenticator = connection.app.state.authenticator
    found = await authenticator.principal(given)
    if found is None:
        raise Unauthorized("invalid bearer token")
    connection.state.principal = found


def admin_guard(connection: Connection, _: BaseRouteHandler) -> None:
    """After `bearer_guard`: only an admin's token manages users, tokens, quotas and device marks."""
    if not principal(connection).admin:
        raise Forbidden(
            "only an admin's token may do this (manage users, tokens and quotas; clear a device's mark)"
        )


def principal(connection: Connection) -> Principal:
    """Who the guard (the API's, or the console's) authenticated for this request."""
    found = connection.state.get("principal")
    assert isinstance(found, Principal), "no guard authenticated this request"
    return found


def actor(connection: Connection) -> str:
    """The caller as the audit record names it: the authenticated principal's actor."""
    return principal(connection).actor
