"""Waiting without sleeping through a stop: for events (`wait_any`), or for any awaitable
(`unless_stopped`)."""

from __future__ import annotations

import asyncio
import enum
from collections.abc import Awaitable
from typing import Final, TypeVar

T = TypeVar("T")


class Stopped(enum.Enum):
    """What `unless_stopped` returns when the stop came first."""

    STOPPED = "stopped"


STOPPED: Final = Stopped.STOPPED


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


async def unless_stopped(
    awaitable: Awaitable[T], stop: asyncio.Event, *, timeout_s: float | None = None
) -> T | Stopped:
    """What `awaitable` returns (or raises), or STOPPED when `stop` is set first; TimeoutError when
    neither comes within `timeout_s`.

    An awaitable that has not finished then is cancelled, and awaited. For a task that must go on, give
    `asyncio.wait({task})`: it waits on the task and, cancelled, leaves it running (and its outcome to
    whoever awaits the task). One that finished (even as it was cancelled) is never lost to the stop:
    its result wins.

    `while (event := await unless_stopped(anext(events), stop)) is not STOPPED: ...`"""
    task = asyncio.ensure_future(awaitable)
    stopping = asyncio.ensure_future(stop.wait())
    try:
        await asyncio.wait({task, stopping}, timeout=timeout_s, return_when=asyncio.FIRST_COMPLETED)
    finally:
        stopping.cancel()
        if not task.done():
            task.cancel()
            await asyncio.wait({task})
    if task.done() and not task.cancelled():
        return task.result()
    if stop.is_set():
        return STOPPED
    raise TimeoutError(f"nothing within {timeout_s}s")
