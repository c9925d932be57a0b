"""Paged lists: `{"items": [...], "next": "<cursor>" | null}` with opaque cursors.

Every list (the scheduler's jobs, nodes and devices; telemetry's steps, checkpoints, incidents
and samples) is built by `page` and reads its cursor back with `decode_cursor`. A cursor is the
last item's sort key as base64 JSON; reading it checks the key's length and the type and range
of each part against the SQL column it is compared with, so a cursor this server did not hand out
is the client's error (`BadCursor`), never a database error.
"""

from __future__ import annotations

import base64
import json
from collections.abc import Sequence
from datetime import datetime
from typing import Any, ClassVar, Literal, TypedDict

from vigil.errors import PermanentError

MAX_LIMIT = 1000
MAX_CURSOR_CHARS = 1024  # real cursors are a few dozen characters

# The SQL type of one part of a sort key.
KeyType = Literal["int", "bigint", "text", "timestamptz"]
_INT_BOUND = {"int": 2**31, "bigint": 2**63}


class Page(TypedDict):
    items: list[dict[str, Any]]
    next: str | None


class BadPageRequest(PermanentError):
    """A paging parameter is wrong; `field` names it."""

    field: ClassVar[str]


class BadCursor(BadPageRequest):
    """A `cursor` that this server did not hand out."""

    field = "cursor"


class BadLimit(BadPageRequest):
    """A `limit` out of range."""

    field = "limit"


def encode_cursor(key: Sequence[Any]) -> str:
    """An opaque cursor for the keyset position after `key` (the last item's sort key)."""
    raw = json.dumps(list(key), default=_json_default, separators=(",", ":"))
    return base64.urlsafe_b64encode(raw.encode()).decode().rstrip("=")


def _json_default(value: Any) -> Any:
    if isinstance(value, datetime):
        return value.isoformat()
    raise TypeError(f"a sort key part must be an int, a str or a datetime, not {type(value).__name__}")


def decode_cursor(cursor: str | None, key: tuple[KeyType, ...]) -> list[Any] | None:
    """The sort key in `cursor` (None, or empty as `?cursor=` sends it, for the first page), one part per
    SQL type in `key`:
    ints for `int`/`bigint`, strs for `text`, aware datetimes for `timestamptz`.

    Raises BadCursor when the cursor is not base64 JSON, not a list of `len(key)` parts, or a part
    is of the wrong type or out of its column's range.
    """
    if not cursor:
        return None
    bad = BadCursor(f"cursor {cursor[:64]!r} is not one this server handed out; start again without it")
    if len(cursor) > MAX_CURSOR_CHARS:
        raise bad
    try:
        parts = json.loads(base64.urlsafe_b64decode(cursor + "=" * (-len(cursor) % 4)))
    except (ValueError, RecursionError) as exc:  # binascii, Unicode and JSON errors are ValueErrors
        raise bad from exc
    if not isinstance(parts, list) or len(parts) != len(key):
        raise bad
    try:
        return [_part(t, v) for t, v in zip(key, parts, strict=True)]
    except ValueError as exc:
        raise bad from exc


def _part(sql_type: KeyType, value: Any) -> Any:
    if sql_type in _INT_BOUND:
        bound = _INT_BOUND[sql_type]
        if type(value) is int and -bound <= value < bound:  # not a bool, not a float
            return value
    elif sql_type == "text":
        if isinstance(value, str) and "\x00" not in value:
            value.encode()  # a lone surrogate cannot be sent to Postgres: UnicodeEncodeError
            return value
    elif sql_type == "timestamptz" and isinstance(value, str):
        at = datetime.fromisoformat(value)
        if at.tzinfo is not None:
            return at
    raise ValueError(f"{value!r} is not a {sql_type}")


def check_limit(limit: int) -> int:
    if not 1 <= limit <= MAX_LIMIT:
        raise BadLimit(f"limit must be between 1 and {MAX_LIMIT}, got {limit}")
    return limit


def page(rows: Sequence[Any], limit: int, key: tuple[str, ...], hidden: tuple[str, ...] = ()) -> Page:
    """A page from up to `limit + 1` rows (dicts or database records) in key order; the extra row
    means there is a next page. `key` names the fields the next cursor holds; `hidden` fields (sort
    keys only) are left out of the items."""
    more = len(rows) > limit
    rows = rows[:limit]
    nxt = encode_cursor([rows[-1][k] for k in key]) if more and rows else None
    items = [{k: v for k, v in dict(r).items() if k not in hidden} for r in rows]
    return {"items": items, "next": nxt}
