"""Webhooks over real HTTP on loopback: delivery, retries with back-off, and a dead hook never blocks."""

from __future__ import annotations

import asyncio
import json
import time

import pytest

from vigil.events import IncidentRaised
from vigil_common.embedded import free_port
from vigil_guardian.notifier import Notifier

pytestmark = pytest.mark.integration


class Hook:
    """A tiny HTTP server answering with the given status codes in turn (then 200)."""

    def __init__(self, statuses: list[int] | None = None, delay_s: float = 0.0) -> None:
        self.statuses = list(statuses or [])
        self.delay_s = delay_s
        self.bodies: list[dict] = []
        self.hits = 0
        self.got = asyncio.Event()
        self.port = free_port()

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head = await reader.readuntil(b"\r\n\r\n")
        length = int(
            next(
                line.split(b":")[1]
                for line in head.split(b"\r\n")
                if line.lower().startswith(b"content-length")
            )
        )
        body = await reader.readexactly(length)
        self.hits += 1
        await asyncio.sleep(self.delay_s)  # the hook's own slowness, under test
        status = self.statuses.pop(0) if self.statuses else 200
        if status == 200:
            self.bodies.append(json.loads(body))
            self.got.set()
        writer.write(f"HTTP/1.1 {status} X\r\nContent-Length: 0\r\nConnection: close\r\n\r\n".encode())
        await writer.drain()
        writer.close()

    async def __aenter__(self) -> Hook:
        self.server = await asyncio.start_server(self.handle, "127.0.0.1", self.port)
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.server.close()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/hook"


def incident(n: int = 0) -> IncidentRaised:
    return IncidentRaised(
        job_id="j-1",
        attempt=1,
        kind="nan",
        action="rollback",
        step=n,
        message=f"nan {n}",
        evidence={"loss": "NaN"},
    )


async def test_incident_posted_as_json_after_retries():
    async with Hook(statuses=[503, 500]) as hook:
        stop = asyncio.Event()
        notifier = Notifier([hook.url], backoff_s=0.05)
        task = asyncio.create_task(notifier.run(stop))
        notifier.notify(incident(7))
        await asyncio.wait_for(hook.got.wait(), 10)
        stop.set()
        await task
    assert hook.hits == 3 and notifier.delivered == 1
    assert (
        hook.bodies[0]["kind"] == "nan"
        and hook.bodies[0]["step"] == 7
        and hook.bodies[0]["evidence"]["loss"] == "NaN"
    )


async def test_a_slow_or_dead_webhook_never_blocks_and_overflow_is_counted():
    dead = f"http://127.0.0.1:{free_port()}/nobody"
    async with Hook(delay_s=5.0) as slow:
        stop = asyncio.Event()
        notifier = Notifier([slow.url, dead], queue_size=3, backoff_s=0.05, timeout_s=10)
        task = asyncio.create_task(notifier.run(stop))
        t0 = time.perf_counter()
        for n in range(20):
            notifier.notify(incident(n))
        elapsed = time.perf_counter() - t0
        # notify never waits on the network: all 20 returned before the slow hook could answer once (a
        # bound with a wide margin, for a loaded machine; 20 notifies take well under a millisecond idle)
        assert elapsed < slow.delay_s / 2, elapsed
        assert notifier.dropped >= 2 * (20 - 3 - 1)  # each URL keeps at most its queue plus one in flight
        stop.set()
        await asyncio.wait_for(task, 2)  # shutdown is not held up by the slow hook either
