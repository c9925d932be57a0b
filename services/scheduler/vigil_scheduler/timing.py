"""Waiting on whichever comes first: a wake-up, the stop event, or a timeout."""

from __future__ import annotations

import asyncio
import contextlib


async def wait_any(event: asyncio.Event, stop: asyncio.Event, timeout_s: float) -> None:
    """Return when `event` or `stop` is set, or after `timeout_s`."""
    waiters = [asyncio.ensure_future(event.wait()), asyncio.ensure_future(stop.wait())]
    try:
        await asyncio.wait(waiters, timeout=timeout_s, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for w in waiters:
            w.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await w
