"""unless_stopped: wait for something unless a stop comes first (the one helper for it)."""

from __future__ import annotations

import asyncio

import pytest

from vigil_common.waiting import STOPPED, unless_stopped, wait_any


async def test_the_result_when_it_comes_first() -> None:
    stop = asyncio.Event()
    queue: asyncio.Queue[str] = asyncio.Queue()
    queue.put_nowait("incident")
    assert await unless_stopped(queue.get(), stop) == "incident"


async def test_stopped_when_the_stop_comes_first_and_the_wait_is_cancelled() -> None:
    stop, never = asyncio.Event(), asyncio.Event()
    cancelled = asyncio.Event()

    async def waits() -> None:
        try:
            await never.wait()
        except asyncio.CancelledError:
            cancelled.set()
            raise

    asyncio.get_running_loop().call_soon(stop.set)
    assert await unless_stopped(waits(), stop) is STOPPED
    assert cancelled.is_set()  # cancelled and awaited before the helper returned


async def test_a_read_cut_short_by_the_stop_takes_nothing() -> None:
    stop = asyncio.Event()
    stop.set()
    queue: asyncio.Queue[int] = asyncio.Queue()
    assert await unless_stopped(queue.get(), stop) is STOPPED
    queue.put_nowait(1)
    assert await unless_stopped(queue.get(), asyncio.Event()) == 1


async def test_a_timeout_raises_and_a_stop_does_not() -> None:
    with pytest.raises(TimeoutError):
        await unless_stopped(asyncio.Event().wait(), asyncio.Event(), timeout_s=0.01)
    stop = asyncio.Event()
    stop.set()
    assert await unless_stopped(asyncio.Event().wait(), stop, timeout_s=0.01) is STOPPED


async def test_what_it_raises_is_raised() -> None:
    async def fails() -> None:
        raise ValueError("bad")

    with pytest.raises(ValueError, match="bad"):
        await unless_stopped(fails(), asyncio.Event())


async def test_a_task_waited_on_goes_on_after_the_stop() -> None:
    stop, release = asyncio.Event(), asyncio.Event()

    async def serves() -> str:
        await release.wait()
        return "served"

    task = asyncio.create_task(serves())
    asyncio.get_running_loop().call_soon(stop.set)
    assert await unless_stopped(asyncio.wait({task}), stop) is STOPPED
    assert not task.done()
    release.set()
    assert await task == "served"


async def test_wait_any_is_a_sleep_that_ends_on_stop() -> None:
    stop = asyncio.Event()
    assert not await wait_any(stop, timeout_s=0.01)
    asyncio.get_running_loop().call_soon(stop.set)
    assert await wait_any(stop)
