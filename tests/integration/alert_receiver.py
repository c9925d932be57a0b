"""A real HTTP receiver for alert deliveries, in the test's own event loop (asyncio streams, HTTP/1.1):
it answers each POST with the next status of its script (then 200), keeps what it got, and lets a
test wait for the n-th request with a deadline."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Iterable
from dataclasses import dataclass, field


@dataclass(frozen=True)
class Received:
    method: str
    path: str
    headers: dict[str, str]  # lower-case names
    body: bytes


@dataclass
class Receiver:
    script: list[int] = field(default_factory=list)
    got: list[Received] = field(default_factory=list)
    url: str = ""
    _changed: asyncio.Condition = field(default_factory=asyncio.Condition)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                line = await reader.readline()
                if not line:
                    return
                method, path, _ = line.decode().split(" ", 2)
                headers: dict[str, str] = {}
                while (h := await reader.readline()) not in (b"\r\n", b"\n", b""):
                    name, _, value = h.decode().partition(":")
                    headers[name.strip().lower()] = value.strip()
                body = await reader.readexactly(int(headers.get("content-length", "0")))
                status = self.script.pop(0) if self.script else 200
                writer.write(f"HTTP/1.1 {status} X\r\ncontent-length: 2\r\n\r\n{{}}".encode())
                await writer.drain()
                async with self._changed:
                    self.got.append(Received(method, path, headers, body))
                    self._changed.notify_all()
        except (ConnectionError, asyncio.IncompleteReadError):
            return
        finally:
            writer.close()

    async def wait_for(self, n: int, timeout_s: float = 20.0) -> list[Received]:
        """The first `n` requests, once they have come (TimeoutError naming what came otherwise)."""
        async with self._changed:
            try:
                await asyncio.wait_for(self._changed.wait_for(lambda: len(self.got) >= n), timeout_s)
            except TimeoutError:
                raise TimeoutError(f"{len(self.got)} of {n} requests in {timeout_s}s: {self.got}") from None
        return self.got[:n]


@contextlib.asynccontextmanager
async def receiver(script: Iterable[int] = ()) -> AsyncIterator[Receiver]:
    r = Receiver(script=list(script))
    server = await asyncio.start_server(r._serve, "127.0.0.1", 0)
    r.url = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}/hook"
    try:
        yield r
    finally:
        server.close()
        with contextlib.suppress(Exception):
            await asyncio.wait_for(server.wait_closed(), 5)
