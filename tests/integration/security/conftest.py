"""One nats-server for the security tests, with the NATS users and permissions `vigil up` gives it (and
compose and Kubernetes, rendered from the same source: tests/integration/deploy/test_nats_users.py),
workers on nodes n1 and n2; a connection per role."""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable, Iterator

import pytest

from tests.integration.secured import secured_nats
from vigil_common.bus import Bus
from vigil_common.embedded import EmbeddedNats

NODES = ("n1", "n2")


@pytest.fixture(scope="package")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EmbeddedNats]:
    with secured_nats(tmp_path_factory.mktemp("security"), NODES) as running:
        yield running


@pytest.fixture
async def connect(server: EmbeddedNats) -> AsyncIterator[Callable[[str], Awaitable[Bus]]]:
    """`await connect(role)`: a Bus logged in as that role's user, closed after the test."""
    made: list[Bus] = []

    async def as_role(role: str) -> Bus:
        bus = await Bus.connect(server.url_for(role), f"test-{role}")
        made.append(bus)
        return bus

    yield as_role
    for bus in made:
        await bus.close()


@pytest.fixture
async def admin(server: EmbeddedNats) -> AsyncIterator[Bus]:
    """Admin, which `vigil up` itself connects as: creates the streams, and stands for the tests' eyes."""
    bus = await Bus.connect(server.url, "test-admin")
    await bus.ensure_streams()
    yield bus
    await bus.close()
