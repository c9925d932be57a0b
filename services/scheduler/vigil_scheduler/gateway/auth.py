"""Bearer-token auth for everything under /api/v1, compared in constant time."""

from __future__ import annotations

import hmac
import logging
import os
import secrets
from pathlib import Path

from litestar.connection import ASGIConnection
from litestar.handlers.base import BaseRouteHandler

from vigil_common.settings import Settings
from vigil_scheduler.gateway.errors import Unauthorized

log = logging.getLogger(__name__)

TOKEN_FILE = "api_token"


def token_path(settings: Settings) -> Path:
    return settings.data_dir / TOKEN_FILE


def resolve_token(settings: Settings) -> str:
    """VIGIL_API_TOKEN, else the token file in the data dir (what `vigil up` writes), else a new one
    written there (mode 0600) so the CLI on this machine finds it."""
    if settings.api_token:
        return settings.api_token
    path = token_path(settings)
    if path.exists():
        token = path.read_text().strip()
        if len(token) >= 16:
            return token
    token = secrets.token_urlsafe(32)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(token + "\n")
    log.info("generated an API token in %s", path)
    return token


def bearer_guard(connection: ASGIConnection, _: BaseRouteHandler) -> None:
    expected: str = connection.app.state.api_token
    header = connection.headers.get("authorization", "")
    scheme, _, given = header.partition(" ")
    if scheme.lower() != "bearer" or not given:
        raise Unauthorized("missing bearer token: send 'Authorization: Bearer <VIGIL_API_TOKEN>'")
    if not hmac.compare_digest(given.strip().encode(), expected.encode()):
        raise Unauthorized("invalid bearer token")
