"""Submit -> schedule -> launch is one trace, and the launch carries it to the workers in its headers."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import httpx
import pytest
from nats.js.api import DeliverPolicy

from vigil_common import subjects
from vigil_common.bus import Bus, msg_id
from vigil_scheduler.main import run

from .conftest import TOKEN, scheduler_settings, spec, wait_ready

pytestmark = pytest.mark.integration

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"


async def test_submit_schedule_launch_is_one_trace(
    db_url: str, nats_url: str, nodes, bus: Bus, tmp_path: Path
) -> None:
    trace_file = tmp_path / "spans.jsonl"
    settings = scheduler_settings(db_url, nats_url, tmp_path, trace_file=trace_file)
    stop = asyncio.Event()
    service = asyncio.create_task(run(settings, stop))
    try:
        node = nodes(slots=1)
        await node.beat()
        await wait_ready(f"http://127.0.0.1:{settings.http_port}", task=service)
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{settings.http_port}") as http:
            r = await http.post(
                "/api/v1/jobs",
                json=spec(per_node=1),
                headers={
                    "Authorization": f"Bearer {TOKEN}",
                    "traceparent": f"00-{TRACE_ID}-00f067aa0ba902b7-01",
                },
            )
        job_id = r.json()["id"]
        sub = await bus.js.subscribe(
            subjects.stored(subjects.launch(job_id)),  # as VIGIL_JOBS stores it
            stream=subjects.JOBS.name,
            ordered_consumer=True,
            deliver_policy=DeliverPolicy.ALL,
        )
        try:
            msg = await sub.next_msg(timeout=15)
        finally:
            await sub.unsubscribe()
        assert msg.headers and msg.headers["traceparent"].split("-")[1] == TRACE_ID
        assert msg.headers["Nats-Msg-Id"] == msg_id(subjects.launch(job_id), f"launch-{job_id}-1")
    finally:
        stop.set()
        await asyncio.wait_for(service, 20)  # shuts the tracer provider down: spans are flushed

    spans = [json.loads(line) for line in trace_file.read_text().splitlines()]
    ours = {s["name"] for s in spans if s["context"]["trace_id"] == "0x" + TRACE_ID}
    assert {"submit job", "schedule job", "publish job.launch"} <= ours, ours
