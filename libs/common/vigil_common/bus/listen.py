"""Listening: what is published on a subject from now on, through a core subscription (nothing stored
is read)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable

from nats.aio.msg import Msg

from vigil.errors import MalformedMessage
from vigil.events import Message
from vigil_common.bus.client import BusClient
from vigil_common.bus.decoding import decode_message
from vigil_common.waiting import wait_any

log = logging.getLogger(__name__)


class Listening(BusClient):
    async def listen(
        self,
        subject: str,
        handler: Callable[[list[Message]], Awaitable[None]],
        stop: asyncio.Event,
        *,
        pending_limit: int = 65_536,
        hearing: asyncio.Event | None = None,
    ) -> None:
        """Run `handler` on the messages published on `subject`, in batches of what arrived while the
        last batch was handled, until `stop`. A core subscription: nothing stored is read back, and
        what is published while this process is away (or too far behind: past `pending_limit`) is
        not heard. For what is sent again and again, where every listener wants every message (each
        guardian hears every GPU sample); malformed messages are logged and skipped. `hearing` is set
        once the server has the subscription."""
        buffer: list[Message] = []
        arrived = asyncio.Event()

        async def on_msg(msg: Msg) -> None:
            try:
                buffer.append(decode_message(msg))
            except MalformedMessage as exc:
                log.warning("listen %s: skipped %s: %s", subject, msg.subject, exc)
                return
            arrived.set()

        sub = await self.nc.subscribe(subject, cb=on_msg, pending_msgs_limit=pending_limit)
        await self.nc.flush()
        if hearing is not None:
            hearing.set()
        try:
            while not stop.is_set():
                if not buffer:
                    arrived.clear()
                    await wait_any(arrived, stop)
                    continue
                batch, buffer[:] = list(buffer), []
                await handler(batch)
        finally:
            with contextlib.suppress(Exception):
                await sub.unsubscribe()
