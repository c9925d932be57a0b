"""A nats-server with Vigil's NATS users, as `vigil up` starts it (one password per role, kept in the data
dir, and the `authorization` block of `vigil_common.credentials`), and how tests watch it refuse."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable, Iterator, Sequence
from pathlib import Path

import nats
from nats.aio.client import Client as NatsClient

from vigil_common import credentials
from vigil_common.embedded import EmbeddedNats


@contextlib.contextmanager
def secured_nats(data_dir: Path, nodes: Sequence[str]) -> Iterator[EmbeddedNats]:
    """What `vigil up` runs (`vigil_cli.stack.infrastructure`), with workers for `nodes`."""
    creds = credentials.load_or_create(data_dir / credentials.CREDENTIALS_FILE, nodes)
    with EmbeddedNats(data_dir / "nats", users=creds.nats) as server:
        yield server


class Refusals:
    """The server's asynchronous `-ERR 'Permissions Violation ...'` lines, as nats-py reports them."""

    def __init__(self) -> None:
        self.seen: list[str] = []
        self.event = asyncio.Event()

    async def on_error(self, exc: Exception) -> None:
        self.seen.append(str(exc))
        self.event.set()

    def of(self, action: str, subject: str) -> list[str]:
        """The refusals of `action` ("publish", "subscription") on `subject`."""
        return [
            s
            for s in self.seen
            if f"permissions violation for {action}" in s.lower() and subject.lower() in s.lower()
        ]


async def raw(server: EmbeddedNats, role: str, refusals: Refusals) -> NatsClient:
    """A bare nats-py connection as `role` (what a leaked credential gives anyone)."""
    return await nats.connect(server.url_for(role), error_cb=refusals.on_error, allow_reconnect=False)


async def refused(
    server: EmbeddedNats,
    role: str,
    attempt: Callable[[NatsClient], Awaitable[object]],
    timeout_s: float = 10.0,
) -> Refusals:
    """Connect as `role`, run `attempt`, and wait for the server's first refusal of it."""
    refusals = Refusals()
    nc = await raw(server, role, refusals)
    try:
        await attempt(nc)
        await nc.flush()
        await asyncio.wait_for(refusals.event.wait(), timeout_s)
    finally:
        await nc.close()
    return refusals
