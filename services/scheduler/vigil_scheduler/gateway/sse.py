"""Server-sent events of bus messages, resumable: what /api/v1/events and the console's feed send.

A stream opens with `event: connected` (no data, so a browser dispatches nothing) once its watch holds:
from then on every message is sent. Each message, and each keep-alive, carries an `id`: where the watch
stands in each subject's stream (`EventStream.position`, written `12.7`). A client that lost the
connection asks again with that id in `Last-Event-ID` and gets what came after it, each message once.
`retry` tells it how soon to ask again.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence

from litestar.exceptions import ValidationException
from litestar.response import ServerSentEventMessage

from vigil.events import Message
from vigil_common.bus import Bus
from vigil_common.waiting import STOPPED, unless_stopped

RETRY_MS = 1000  # how soon a client that lost the stream connects again
LAST_EVENT_ID = "Last-Event-ID"


def position_id(position: Sequence[int]) -> str:
    """The `id` of an event sent at `position` (one stream sequence per subject watched)."""
    return ".".join(str(seq) for seq in position)


def parse_last_event_id(value: str | None, subjects: int) -> tuple[int, ...] | None:
    """The position a `Last-Event-ID` header names (None without one); a 422 naming the header if it is
    not an id this stream sent."""
    if value is None or not value.strip():
        return None
    parts = value.strip().split(".")
    if len(parts) != subjects or not all(p.isdigit() and len(p) <= 19 and int(p) >= 1 for p in parts):
        raise ValidationException(
            f"{LAST_EVENT_ID} {value[:64]!r} is not an id this event stream sent",
            extra=[{"key": LAST_EVENT_ID, "message": f"expected {subjects} stream sequences joined by '.'"}],
        )
    return tuple(int(p) for p in parts)


async def watched_events(
    bus: Bus,
    closing: asyncio.Event,
    filter_subjects: Sequence[str],
    shown: Callable[[Message], Awaitable[bool]],
    *,
    resume_at: Sequence[int] | None,
    keepalive_s: float,
) -> AsyncIterator[ServerSentEventMessage]:
    """The messages on `filter_subjects` that `shown` admits, from `resume_at` (else from now), each as
    an event named after its type; a keep-alive comment after `keepalive_s` without one. Ends when
    `closing` is set."""
    async with bus.watch(*filter_subjects, resume_at=resume_at) as events:
        stream = aiter(events)
        yield ServerSentEventMessage(
            comment="connected", event="connected", id=position_id(events.position), retry=RETRY_MS, data=None
        )
        while True:
            try:
                message = await unless_stopped(anext(stream), closing, timeout_s=keepalive_s)
            except TimeoutError:
                yield ServerSentEventMessage(comment="keep-alive", id=position_id(events.position), data=None)
                continue
            if message is STOPPED:
                return
            if await shown(message):
                yield ServerSentEventMessage(
                    data=message.model_dump_json(), event=message.type, id=position_id(events.position)
                )
