"""`/metrics` over HTTP on loopback, and a busy port that costs only the metrics."""

from __future__ import annotations

import asyncio
import logging
import socket

import httpx
import pytest

from tests.helpers import eventually
from vigil_common.embedded import free_port
from vigil_telemetry.metrics import Registry, serve_metrics

pytestmark = pytest.mark.integration


async def test_serves_metrics_and_404_elsewhere():
    registry, stop, port = Registry(), asyncio.Event(), free_port()
    registry.inc("vigil_incidents_total", kind="nan", action="halt")
    server = asyncio.create_task(serve_metrics(registry, "127.0.0.1", port, stop))
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}") as client:

        async def up():  # ready: a 200 (a 404 or a 503 from something else on the port is not this server)
            try:
                response = await client.get("/metrics")
            except httpx.ConnectError:
                return None
            return response if response.status_code == 200 else None

        response = await eventually(up, timeout=10, what="the metrics server")
        assert response.status_code == 200 and response.headers["content-type"].startswith("text/plain")
        assert 'vigil_incidents_total{action="halt",kind="nan"} 1' in response.text
        assert (await client.get("/other")).status_code == 404
    stop.set()
    await asyncio.wait_for(server, 5)


async def test_a_busy_port_turns_metrics_off_without_failing(caplog: pytest.LogCaptureFixture):
    stop = asyncio.Event()  # never set: a server that served would wait on it, and time out here
    with socket.socket() as taken, caplog.at_level(logging.ERROR, logger="vigil_telemetry.metrics"):
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        await asyncio.wait_for(serve_metrics(Registry(), "127.0.0.1", port, stop), 5)  # returns: off
        assert not stop.is_set()
    (error,) = [r for r in caplog.records if "cannot serve /metrics" in r.getMessage()]
    assert f"127.0.0.1:{port}" in error.getMessage() and "VIGIL_METRICS_PORT" in error.getMessage()
