"""The gateway's server-sent events as a client lives with them: quiet gaps longer than the keep-alive,
and a connection cut mid-stream, resumed with `Last-Event-ID` without losing or repeating an event.

The client reaches the gateway through a TCP proxy of the test's own, which counts the keep-alives it
carries and can cut every open connection (and refuse new ones for a while)."""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest
from click.testing import CliRunner

import vigil
from tests.helpers import eventually
from vigil.events import JobStateChanged
from vigil.jobstates import JobState
from vigil_cli.main import cli
from vigil_common import subjects
from vigil_common.bus import Bus
from vigil_common.embedded import free_port

from .conftest import (
    TOKEN,
    Running,
    count_on,
    exit_rank,
    launched,
    running,
    scheduler_settings,
    start_ranks,
    wait_state,
)

pytestmark = pytest.mark.integration

KEEPALIVE_S = 0.5
KEEPALIVE = b"\n: keep-alive"  # a comment line (the response headers hold "connection: keep-alive")


class Proxy:
    """127.0.0.1:`port` forwarded to the gateway at `upstream`."""

    def __init__(self, upstream: int) -> None:
        self.upstream = upstream
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.downstream = bytearray()  # every byte the gateway sent a client, all connections
        self._keepalives = 0
        self._wanted: tuple[int, asyncio.Event] | None = None
        self._open: set[asyncio.StreamWriter] = set()
        self._server: asyncio.Server | None = None

    async def listen(self) -> None:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", self.port)

    async def cut(self) -> None:
        """Stop accepting, and reset every open connection (both sides)."""
        assert self._server is not None
        self._server.close()
        for writer in list(self._open):
            writer.transport.abort()
        await self._server.wait_closed()

    async def keepalives(self, more: int, timeout_s: float = 15.0) -> None:
        """Wait until `more` keep-alives beyond those seen so far have reached the client."""
        reached = asyncio.Event()
        self._wanted = (self._keepalives + more, reached)
        await asyncio.wait_for(reached.wait(), timeout_s)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.upstream)
        self._open |= {writer, up_writer}
        try:
            await asyncio.gather(self._pump(reader, up_writer), self._pump(up_reader, writer, down=True))
        finally:
            self._open -= {writer, up_writer}

    async def _pump(self, src: asyncio.StreamReader, dst: asyncio.StreamWriter, down: bool = False) -> None:
        try:
            while data := await src.read(65536):
                if down:
                    self._seen(data)
                dst.write(data)
                await dst.drain()
        except OSError:
            pass  # cut
        finally:
            dst.close()

    def _seen(self, data: bytes) -> None:
        tail = len(self.downstream)
        self.downstream += data
        self._keepalives += self.downstream.count(KEEPALIVE, max(0, tail - len(KEEPALIVE) + 1))
        if self._wanted is not None and self._keepalives >= self._wanted[0]:
            self._wanted[1].set()


@pytest.fixture
async def quiet(db_url: str, nats_url: str, tmp_path: Path) -> AsyncIterator[Running]:
    """A scheduler whose event streams get a keep-alive after KEEPALIVE_S without an event."""
    async with running(scheduler_settings(db_url, nats_url, tmp_path, sse_keepalive_s=KEEPALIVE_S)) as s:
        yield s


@pytest.fixture
async def proxy(quiet: Running) -> AsyncIterator[Proxy]:
    made = Proxy(quiet.settings.http_port)
    await made.listen()
    yield made
    with contextlib.suppress(AssertionError, OSError):
        await made.cut()


async def test_wait_outlasts_a_gap_longer_than_the_keepalive(
    quiet: Running, proxy: Proxy, nodes, bus
) -> None:
    await nodes(slots=1).beat()
    seen: list[object] = []
    with vigil.Client(proxy.url, TOKEN, timeout_s=10) as client:
        job = await asyncio.to_thread(client.submit, {"name": "quiet", "resources": {"gpus_per_node": 1}})
        waiting = asyncio.create_task(asyncio.to_thread(client.wait, job.id, on_event=seen.append))
        launch = await launched(bus, job.id)
        await start_ranks(bus, launch)
        await wait_state(bus, job.id, "RUNNING")
        await proxy.keepalives(4)  # two seconds and more without an event
        assert not waiting.done()
        await exit_rank(bus, launch, 0, 0)
        final = await asyncio.wait_for(waiting, 20)
    assert final.state == JobState.SUCCEEDED
    assert [e.to_state for e in seen if isinstance(e, JobStateChanged)][-1] == JobState.SUCCEEDED
    # A keep-alive is a comment with the stream's position and nothing a browser would dispatch.
    block = bytes(proxy.downstream).split(KEEPALIVE, 1)[1].split(b"\r\n\r\n", 1)[0]
    assert block.startswith(b"\r\nid: ") and b"data:" not in block and b"event:" not in block


async def test_submit_follow_exits_0_after_a_gap_longer_than_the_keepalive(
    quiet: Running, proxy: Proxy, nodes, bus: Bus, tmp_path: Path
) -> None:
    await nodes(slots=1).beat()
    spec_file = tmp_path / "job.yaml"
    spec_file.write_text("name: followed-quietly\nresources: {gpus_per_node: 1}\ntrain: {steps: 5}\n")
    env = {"VIGIL_API_TOKEN": TOKEN, "VIGIL_API_URL": proxy.url, "COLUMNS": "200"}
    args = ["submit", str(spec_file), "--follow"]
    follow = asyncio.create_task(asyncio.to_thread(CliRunner().invoke, cli, args, env=env))
    job_id = await _first_job(quiet)
    launch = await launched(bus, job_id)
    await start_ranks(bus, launch)
    await wait_state(bus, job_id, "RUNNING")
    await proxy.keepalives(4)
    assert not follow.done()
    await exit_rank(bus, launch, 0, 0)
    result = await asyncio.wait_for(follow, 20)
    assert result.exit_code == 0, result.output
    assert "SUCCEEDED" in result.output


async def test_a_cut_stream_resumes_after_its_last_event_and_yields_each_event_once(
    quiet: Running, proxy: Proxy, bus: Bus
) -> None:
    loop = asyncio.get_running_loop()
    received: asyncio.Queue[JobStateChanged] = asyncio.Queue()
    connects: asyncio.Queue[None] = asyncio.Queue()
    last_job: list[str] = []  # the job whose first event ends the reading
    stop = threading.Event()

    def read() -> list[JobStateChanged]:
        got: list[JobStateChanged] = []
        with vigil.Client(proxy.url, TOKEN, timeout_s=10) as client:
            connected = lambda: loop.call_soon_threadsafe(connects.put_nowait, None)  # noqa: E731
            for event in client.events(on_connect=connected, reconnect_for_s=20):
                if isinstance(event, JobStateChanged):
                    got.append(event)
                    loop.call_soon_threadsafe(received.put_nowait, event)
                    if (last_job and event.job_id == last_job[0]) or stop.is_set():
                        return got
        return got

    async def submit(name: str) -> str:
        r = await quiet.http.post("/api/v1/jobs", json={"name": name, "resources": {"gpus_per_node": 1}})
        assert r.status_code == 201, r.text
        return r.json()["id"]

    async def event_of(job_id: str) -> JobStateChanged:
        while (event := await asyncio.wait_for(received.get(), 15)).job_id != job_id:
            pass
        return event

    reader = asyncio.create_task(asyncio.to_thread(read))
    try:
        await asyncio.wait_for(connects.get(), 15)
        first = await submit("before-the-cut")
        await event_of(first)
        await proxy.cut()  # the client's connection reset; for now no new one is accepted
        during = [await submit("during-the-cut-1"), await submit("during-the-cut-2")]
        for job_id in during:
            await wait_state(bus, job_id, "PENDING")  # stored while the client is away
        await proxy.listen()
        await asyncio.wait_for(connects.get(), 15)  # connected again, after the gateway's retry delay
        last_job.append(await submit("after-the-cut"))
        got = await asyncio.wait_for(reader, 20)
    finally:
        stop.set()
    ours = [first, *during, last_job[0]]
    mine = [e for e in got if e.job_id in ours]
    assert len({e.event_id for e in mine}) == len(mine), "an event was yielded twice"
    stored = [e for job_id in ours for e in await _status_events(bus, job_id)]
    assert sorted(e.event_id for e in mine) == sorted(e.event_id for e in stored)
    assert {e.job_id for e in mine} == set(ours)


FEEDS = ["/api/v1/events", "/console/events"]  # the API's, and the console's jobs and incidents pages


@pytest.mark.parametrize("feed", FEEDS)
async def test_a_last_event_id_the_stream_never_sent_is_refused_naming_the_header(
    quiet: Running, feed: str
) -> None:
    for bad in ("3f2a9c0e-uuid", "12", "0.1", "1.2.3"):
        r = await quiet.http.get(feed, headers={"Last-Event-ID": bad})
        assert r.status_code == 422, (bad, r.text)
        assert [f["field"] for f in r.json()["fields"]] == ["Last-Event-ID"], r.text


@pytest.mark.parametrize("feed", FEEDS)
async def test_a_resumed_stream_starts_after_the_id_it_names(quiet: Running, bus: Bus, feed: str) -> None:
    """What a browser's EventSource does by itself: the raw stream, asked again with the id of the
    connected line, carries the event published in between."""
    async with httpx.AsyncClient(base_url=quiet.base_url, headers=quiet.http.headers, timeout=30) as http:
        async with http.stream("GET", feed) as first:
            lines = first.aiter_lines()
            opening = [await anext(lines) for _ in range(5)]  # a comment, then an event with no data
            assert opening[0] == ": connected" and opening[1].startswith("id: ")
            assert opening[2:] == ["event: connected", "retry: 1000", ""], opening
            position = opening[1].removeprefix("id: ")
        job = (await quiet.http.post("/api/v1/jobs", json={"name": "in-between"})).json()["id"]
        await wait_state(bus, job, "PENDING")
        async with http.stream("GET", feed, headers={"Last-Event-ID": position}) as again:
            data = None
            async for line in again.aiter_lines():
                if line.startswith("data: "):
                    data = JobStateChanged.model_validate_json(line.removeprefix("data: "))
                    break
    assert data is not None and data.job_id == job and data.to_state == JobState.PENDING


async def _status_events(bus: Bus, job_id: str) -> list[JobStateChanged]:
    """The job's JobStateChanged events as the bus stores them (every status message it holds, read)."""
    subject = subjects.job_status(job_id)
    stored = await count_on(bus, subjects.JOBS.name, subject)
    async with bus.watch(subject, from_start=True) as events:
        read = [await asyncio.wait_for(anext(events), 5) for _ in range(stored)]
    return [e for e in read if isinstance(e, JobStateChanged)]


async def _first_job(scheduler: Running) -> str:
    async def only() -> str | None:
        items = (await scheduler.http.get("/api/v1/jobs")).json()["items"]
        return items[0]["id"] if items else None

    return await eventually(only, what="the submission to land")
