"""Core NATS request/reply (nothing stored), for the benchmarks' floors only: no service asks another
and waits for its answer, every service talks through the streams (`vigil_common.bus`)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

from nats.aio.msg import Msg

from vigil.events import Message, decode
from vigil_common import tracing
from vigil_common.bus import Bus


async def request(bus: Bus, subject: str, event: Message, *, timeout_s: float = 5.0) -> Message:
    """Send `event` on `subject` and wait for the one answer, decoded."""
    headers = tracing.inject({})
    msg = await bus.nc.request(subject, event.to_bytes(), timeout=timeout_s, headers=headers)
    return decode(msg.data)


async def serve(bus: Bus, subject: str, handler: Callable[[Message], Awaitable[Message]]) -> Any:
    """Answer requests on `subject` with `handler`; returns the subscription (unsubscribe to stop)."""

    async def on_msg(msg: Msg) -> None:
        reply = await handler(decode(msg.data))
        await msg.respond(reply.to_bytes())

    return await bus.nc.subscribe(subject, cb=on_msg)
