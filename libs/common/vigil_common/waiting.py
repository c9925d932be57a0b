"""Waiting on events without sleeping through a stop."""

from __future__ import annotations

import asyncio


async def wait_any(*events: asyncio.Event, timeout_s: float | None = None) -> bool:
    """Wait until any of `events` is set or `timeout_s` passes; True when one was set.

    `await wait_any(stop, timeout_s=5)` is a sleep that ends early on stop."""
    waiters = [asyncio.ensure_future(e.wait()) for e in events]
    try:
        await asyncio.wait(waiters, timeout=timeout_s, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for w in waiters:
            w.cancel()
        await asyncio.gather(*waiters, return_exceptions=True)
    return any(e.is_set() for e in events)
