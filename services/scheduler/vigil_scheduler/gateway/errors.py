"""The one place errors become HTTP responses: VigilError's hierarchy and Litestar's own exceptions
map to a JSON body `{"status", "error", "message", "fields"}`."""

from __future__ import annotations

import logging
from typing import Any

from litestar import MediaType, Request, Response
from litestar.exceptions import HTTPException, ValidationException
from litestar.status_codes import (
    HTTP_401_UNAUTHORIZED,
    HTTP_403_FORBIDDEN,
    HTTP_404_NOT_FOUND,
    HTTP_409_CONFLICT,
    HTTP_413_REQUEST_ENTITY_TOO_LARGE,
    HTTP_422_UNPROCESSABLE_ENTITY,
    HTTP_500_INTERNAL_SERVER_ERROR,
    HTTP_503_SERVICE_UNAVAILABLE,
)

from vigil.errors import Conflict, NotFound, PermanentError, RetryableError, SpecError, VigilError
from vigil_common.pages import BadPageRequest

log = logging.getLogger(__name__)


class Unauthorized(PermanentError):
    """No bearer token, or the wrong one."""


class Forbidden(PermanentError):
    """A console write that did not come from the console's own page (its Origin, its CSRF token), or a
    user's token on a route for admins."""


class BadForm(PermanentError):
    """A console form that cannot be read; `field` names the field."""

    def __init__(self, field: str, message: str) -> None:
        self.field = field
        super().__init__(message)


def _status(exc: VigilError) -> int:
    if isinstance(exc, Unauthorized):
        return HTTP_401_UNAUTHORIZED
    if isinstance(exc, Forbidden):
        return HTTP_403_FORBIDDEN
    if isinstance(exc, NotFound):
        return HTTP_404_NOT_FOUND
    if isinstance(exc, Conflict):
        return HTTP_409_CONFLICT
    if isinstance(exc, PermanentError):  # bad spec, bad cursor or limit: the request itself is wrong
        return HTTP_422_UNPROCESSABLE_ENTITY
    if isinstance(exc, RetryableError):
        return HTTP_503_SERVICE_UNAVAILABLE
    return HTTP_500_INTERNAL_SERVER_ERROR


# Handler arguments whose name differs from the query parameter they read (`state` is Litestar's own).
_PARAMETER_NAMES = {"state_filter": "state"}


def _fields(exc: Exception) -> list[dict[str, str]]:
    if isinstance(exc, SpecError):
        return exc.errors
    if isinstance(exc, BadPageRequest | BadForm):
        return [{"field": exc.field, "message": str(exc)}]
    if isinstance(exc, ValidationException) and isinstance(exc.extra, list):
        return [
            {
                "field": _PARAMETER_NAMES.get(key, key),
                "message": str(e.get("message", "")),
            }
            for e in exc.extra
            if isinstance(e, dict) and (key := str(e.get("key") or e.get("source") or "(request)"))
        ]
    return []


def body(status: int, error: str, message: str, fields: list[dict[str, str]] | None = None) -> dict[str, Any]:
    return {"status": status, "error": error, "message": message, "fields": fields or []}


def vigil_error(request: Request, exc: VigilError) -> Response[dict[str, Any]]:
    status = _status(exc)
    if status >= 500:
        log.error("%s %s: %s", request.method, request.url.path, exc)
    headers = {"WWW-Authenticate": "Bearer"} if status == HTTP_401_UNAUTHORIZED else None
    return Response(
        body(status, type(exc).__name__, str(exc), _fields(exc)),
        status_code=status,
        media_type=MediaType.JSON,
        headers=headers,
    )


def http_error(request: Request, exc: HTTPException) -> Response[dict[str, Any]]:
    status = HTTP_422_UNPROCESSABLE_ENTITY if isinstance(exc, ValidationException) else exc.status_code
    message = exc.detail
    if status == HTTP_413_REQUEST_ENTITY_TOO_LARGE and not getattr(exc, "names_its_limit", False):
        limit = request.app.request_max_body_size
        message = f"the body is larger than VIGIL_MAX_BODY_BYTES ({limit} bytes)"
    return Response(
        body(status, type(exc).__name__, message, _fields(exc)),
        status_code=status,
        media_type=MediaType.JSON,
        headers=exc.headers,
    )


def internal_error(request: Request, exc: Exception) -> Response[dict[str, Any]]:
    log.exception("%s %s failed", request.method, request.url.path, exc_info=exc)
    status = HTTP_500_INTERNAL_SERVER_ERROR
    return Response(
        body(status, "InternalError", "internal error; see the scheduler's log"), status_code=status
    )


EXCEPTION_HANDLERS = {VigilError: vigil_error, HTTPException: http_error, Exception: internal_error}
