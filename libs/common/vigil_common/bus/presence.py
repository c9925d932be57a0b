"""Presence: is a process still connected to NATS? Core request-reply, nothing stored.

A worker answers requests on its node's ping subject (`subjects.ping`) while its connection stands. The
server knows at once when a process's TCP connection closes (a process killed, a host that resets the
connection): then nobody holds the subscription, and a request is answered "no responders" by the server
itself, in one round trip. That is the strong evidence the scheduler acts on before three heartbeats are
missed. A request that times out proves nothing (a host cut off, or one too busy to answer): the
heartbeats decide that case.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import logging

import nats.errors
from nats.aio.msg import Msg

from vigil_common.bus.client import BusClient
from vigil_common.waiting import wait_any

log = logging.getLogger(__name__)


class Presence(enum.Enum):
    ANSWERED = "answered"  # the process answered: connected and serving
    GONE = "gone"  # the server holds no subscriber: the process's connection is closed
    UNKNOWN = "unknown"  # no answer in time: cut off, or busy; proves nothing


class Presences(BusClient):
    async def answer_pings(
        self, subject: str, stop: asyncio.Event, ready: asyncio.Event | None = None
    ) -> None:
        """Answer every request on `subject` until `stop`; `ready` is set once the server has the
        subscription (so that a heartbeat is never sent by a node that would not answer)."""

        async def on_msg(msg: Msg) -> None:
            if msg.reply:
                with contextlib.suppress(nats.errors.Error):
                    await msg.respond(b"")

        sub = await self.nc.subscribe(subject, cb=on_msg)
        await self.nc.flush()
        if ready is not None:
            ready.set()
        try:
            await wait_any(stop)
        finally:
            with contextlib.suppress(Exception):
                await sub.unsubscribe()

    async def presence(self, subject: str, timeout_s: float = 1.0) -> Presence:
        """Ask whoever answers `subject` (a worker's ping) whether it is there."""
        try:
            await self.nc.request(subject, b"", timeout=timeout_s)
        except nats.errors.NoRespondersError:
            return Presence.GONE
        except (nats.errors.TimeoutError, nats.errors.Error) as exc:
            log.debug("presence %s: no answer (%r)", subject, exc)
            return Presence.UNKNOWN
        return Presence.ANSWERED
