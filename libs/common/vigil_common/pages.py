"""Paged lists: `{"items": [...], "next": "<cursor>" | null}` with opaque cursors."""

from __future__ import annotations

import base64
import json
from typing import Any, TypedDict

from vigil_common.errors import PermanentError

MAX_LIMIT = 1000


class Page(TypedDict):
    items: list[dict[str, Any]]
    next: str | None


class BadCursor(PermanentError):
    """A `cursor` that this server did not hand out."""


def encode_cursor(key: list[Any]) -> str:
    """An opaque cursor for the keyset position after `key` (the last item's sort key)."""
    return base64.urlsafe_b64encode(json.dumps(key, default=str).encode()).decode().rstrip("=")


def decode_cursor(cursor: str | None) -> list[Any] | None:
    if cursor is None:
        return None
    try:
        raw = base64.urlsafe_b64decode(cursor + "=" * (-len(cursor) % 4))
        key = json.loads(raw)
    except (ValueError, json.JSONDecodeError) as exc:
        raise BadCursor(f"cursor {cursor!r} is not one this server handed out") from exc
    if not isinstance(key, list):
        raise BadCursor(f"cursor {cursor!r} is not one this server handed out")
    return key


def check_limit(limit: int) -> int:
    if not 1 <= limit <= MAX_LIMIT:
        raise PermanentError(f"limit must be between 1 and {MAX_LIMIT}, got {limit}")
    return limit


def page(items: list[dict[str, Any]], limit: int, key_fields: tuple[str, ...]) -> Page:
    """A page from up to `limit + 1` rows in key order; the extra row means there is a next page."""
    more = len(items) > limit
    items = items[:limit]
    nxt = encode_cursor([items[-1][f] for f in key_fields]) if more and items else None
    return {"items": items, "next": nxt}
