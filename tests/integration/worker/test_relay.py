"""A rank's link to its agent (the SDK's `AgentLink`) and the agent's relay, against a real NATS: events
reach the bus on the agent's node subjects, in order, never blocking the training loop; only the rank
the agent started, with its token, gets through, and only for its own job, attempt and rank; the
job's commands reach every rank numbered in stream order; a restarted agent is reconnected to."""

from __future__ import annotations

import asyncio
import os
import secrets
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator
from dataclasses import replace
from pathlib import Path

import pytest

from tests.helpers import step_completed
from vigil import events as ev
from vigil import protocol as proto
from vigil.link import AgentLink
from vigil_common import subjects
from vigil_worker import tenancy
from vigil_worker.procs import RankRecord
from vigil_worker.relay import Relay

pytestmark = pytest.mark.integration

NODE = "relay-node"


def step_event(job_id: str, step: int, rank: int = 0, attempt: int = 1) -> ev.StepCompleted:
    return step_completed(job_id, step, rank, loss=1.0, attempt=attempt, node=NODE)


class Ranks:
    """Stands in for the agent's RankTable: the ranks it started, with their tokens."""

    def __init__(self) -> None:
        self.records: dict[tuple[str, int, int], RankRecord] = {}

    def add(self, job_id: str, rank: int, attempt: int = 1) -> str:
        token = secrets.token_urlsafe(32)
        self.records[(job_id, attempt, rank)] = RankRecord(
            job_id=job_id, attempt=attempt, rank=rank, device=rank, pid=1, ticks=1, log_path="", exit_path="",
            token=token,
        )  # fmt: skip
        return token

    def find(self, job_id: str, attempt: int, rank: int) -> RankRecord | None:
        return self.records.get((job_id, attempt, rank))


@pytest.fixture
async def relay(bus) -> AsyncIterator[tuple[Relay, Ranks]]:
    ranks = Ranks()
    folder = Path(tempfile.mkdtemp(prefix="vigil-relay-"))
    r = await Relay(bus, NODE, folder / "agent.sock", folder / "checkpoints", ranks.find).start()
    yield r, ranks
    await r.close()


async def link(r: Relay, job_id: str, rank: int, token: str, attempt: int = 1, **kw: int) -> AgentLink:
    hello = proto.Hello(job_id=job_id, attempt=attempt, rank=rank, token=token)
    return await asyncio.to_thread(AgentLink(r.socket_path, hello, **kw).start, 10.0)


async def test_events_reach_the_bus_in_order_and_a_full_queue_drops_instead_of_blocking(relay, bus, job_id):
    r, ranks = relay
    rank = await link(r, job_id, 0, ranks.add(job_id, 0), queue_size=8)
    async with bus.watch(subjects.step(job_id, NODE)) as stream:
        t0 = time.perf_counter()
        for step in range(2000):
            rank.emit(step_event(job_id, step))
        emit_s = time.perf_counter() - t0
        await asyncio.to_thread(rank.close)
        delivered = 2000 - rank.dropped
        got = [await asyncio.wait_for(anext(stream), 10) for _ in range(delivered)]
    # emit never waits for the agent: a full queue (8) dropped events instead of blocking the rank
    assert rank.dropped > 0 and rank.refused == 0, f"2000 emits in {emit_s:.3f}s, none dropped"
    assert [e.step for e in got] == sorted(e.step for e in got)  # in order, gaps where dropped
    assert rank.last_step == got[-1].step


@pytest.mark.security
async def test_a_wrong_token_or_a_rank_it_did_not_start_is_refused(relay, job_id):
    r, ranks = relay
    ranks.add(job_id, 0)
    with pytest.raises(PermissionError):
        await link(r, job_id, 0, secrets.token_urlsafe(32))  # not its token
    with pytest.raises(PermissionError):
        await link(r, job_id, 1, ranks.records[(job_id, 1, 0)].token)  # rank 1 was never started


HELLO_FROM_A_CHILD = """
import json, socket, sys
with socket.socket(socket.AF_UNIX) as s:
    s.connect(sys.argv[1])
    s.sendall(sys.argv[2].encode() + b"\\n")
    print(s.makefile().readline(), flush=True)
"""


def hello_as(uid: int | None, r: Relay, hello: proto.Hello) -> str:
    """The relay's answer to `hello` sent by a process running as `uid` (None: this process's user)."""
    enter = None if uid is None else tenancy.enter(tenancy.JobUser(uid), None)
    argv = [sys.executable, "-c", HELLO_FROM_A_CHILD, str(r.socket_path), hello.model_dump_json()]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=30, preexec_fn=enter, check=True)
    return done.stdout


@pytest.mark.security
@pytest.mark.skipif(os.geteuid() != 0, reason="another uid needs a root test")
async def test_a_token_works_only_from_the_uid_its_rank_runs_as(relay, job_id):
    r, ranks = relay
    token = ranks.add(job_id, 0)
    ranks.records[(job_id, 1, 0)] = replace(ranks.records[(job_id, 1, 0)], uid=61020)
    hello = proto.Hello(job_id=job_id, attempt=1, rank=0, token=token)
    assert '"welcome"' in await asyncio.to_thread(hello_as, 61020, r, hello)
    assert '"refused"' in await asyncio.to_thread(hello_as, 61021, r, hello)  # a stolen token
    assert '"refused"' in await asyncio.to_thread(hello_as, None, r, hello)  # even the worker's own user


@pytest.mark.security
async def test_a_rank_publishes_only_for_its_own_job_attempt_rank_and_node(relay, bus, job_id):
    r, ranks = relay
    other = job_id + "-other"
    one = await link(r, job_id, 1, ranks.add(job_id, 1))
    async with bus.watch(subjects.ALL_STEPS, subjects.ALL_STATUS) as stream:
        forged = [
            step_event(other, 5, rank=1),  # another job
            step_event(job_id, 5, rank=0),  # another rank
            step_event(job_id, 5, rank=1, attempt=2),  # another attempt
            step_event(job_id, 5, rank=1).model_copy(update={"node": "elsewhere"}),  # another node
            ev.RanksHalted(job_id=job_id, attempt=1, step=5, command_id="c", node=NODE),  # rank 0's to say
        ]
        for event in forged:
            one.emit(event)
        one.emit(step_event(job_id, 6, rank=1))
        assert await asyncio.to_thread(one.flush, 10.0)
        reports: list[ev.ReportRefused] = []
        while not isinstance(got := await asyncio.wait_for(anext(stream), 10), ev.StepCompleted):
            reports.append(got)  # the guardian hears of each refusal (once per job and field)
    await asyncio.to_thread(one.close)
    assert (got.job_id, got.rank, got.step) == (job_id, 1, 6), "only the genuine step got through"
    assert one.refused == len(forged) and r.refused == len(forged)
    assert all(isinstance(x, ev.ReportRefused) and x.job_id == job_id for x in reports), reports
    assert {x.field for x in reports} == {"job_id", "rank", "attempt", "node"}


@pytest.mark.security
async def test_a_checkpoint_outside_the_jobs_folder_is_refused(relay, bus, job_id):
    r, ranks = relay
    zero = await link(r, job_id, 0, ranks.add(job_id, 0))
    root = r.checkpoint_root
    for path in (root / "another-job" / "step_00000010", Path("/etc"), root / job_id / ".." / "x"):
        zero.emit(
            ev.CheckpointSaved(
                job_id=job_id,
                attempt=1,
                step=10,
                path=str(path),
                bytes=1,
                manifest_sha256="0",
                data_position=10,
            )
        )
    assert await asyncio.to_thread(zero.flush, 10.0)
    await asyncio.to_thread(zero.close)
    assert zero.refused == 3


@pytest.mark.security
async def test_commands_reach_every_rank_numbered_in_stream_order(relay, bus, job_id):
    r, ranks = relay
    before = ev.HaltJob(job_id=job_id, attempt=1, reason="sent before the ranks started")
    await bus.publish(subjects.cmd(job_id), before)
    await bus.publish(subjects.cmd(job_id), ev.CancelJob(job_id=job_id, attempt=1))  # the agent's, not theirs
    a = await link(r, job_id, 0, ranks.add(job_id, 0))
    b = await link(r, job_id, 1, ranks.add(job_id, 1))
    try:
        after = ev.ResumeJob(job_id=job_id, attempt=1)
        await bus.publish(subjects.cmd(job_id), after)
        await bus.publish(
            subjects.cmd(job_id + "-other"), ev.HaltJob(job_id=job_id + "-other", attempt=1, reason="x")
        )
        marker = ev.ResumeJob(job_id=job_id, attempt=1)  # published last: whatever came before it, came
        await bus.publish(subjects.cmd(job_id), marker)
        for rank in (a, b):
            got = [await asyncio.to_thread(rank.command, seq, 10.0) for seq in (1, 2, 3)]
            # neither the cancel nor another job's command between them: the marker is the third
            assert [c.event_id for c in got] == [before.event_id, after.event_id, marker.event_id]
            assert rank.latest_seq == 3
    finally:
        await asyncio.to_thread(a.close)
        await asyncio.to_thread(b.close)


async def test_a_restarted_agent_is_reconnected_to_and_nothing_is_lost(bus, job_id):
    ranks = Ranks()
    token = ranks.add(job_id, 0)
    folder = Path(tempfile.mkdtemp(prefix="vigil-relay-"))
    path = folder / "agent.sock"
    first = await Relay(bus, NODE, path, folder / "checkpoints", ranks.find).start()
    rank = await link(first, job_id, 0, token)
    async with bus.watch(subjects.step(job_id, NODE)) as stream:
        rank.emit(step_event(job_id, 0))
        assert await asyncio.to_thread(rank.flush, 10.0)
        await first.close()  # the worker restarts
        rank.emit(step_event(job_id, 1))  # queued while no agent listens
        second = await Relay(bus, NODE, path, folder / "checkpoints", ranks.find).start()
        try:
            assert await asyncio.to_thread(rank.flush, 20.0), "the link reconnects and sends what was queued"
            got = [await asyncio.wait_for(anext(stream), 10) for _ in range(2)]
        finally:
            await asyncio.to_thread(rank.close)
            await second.close()
    assert [e.step for e in got] == [0, 1]


async def stored_in_order(bus, job_id: str, count: int) -> list[ev.Message]:
    """The first `count` events VIGIL_JOBS stores of `job_id`, in the stream's order."""
    got: list[ev.Message] = []
    seq = 1
    deadline = time.monotonic() + 20
    while len(got) < count and time.monotonic() < deadline:
        stored = await bus.next_stored(subjects.JOBS.name, subjects.job_events(job_id), seq)
        if stored is None:
            await asyncio.sleep(0.05)  # polling the stream for what is still being stored
            continue
        got.append(ev.decode(stored.data))
        seq = stored.seq + 1
    return got


async def test_steps_are_pipelined_in_order_and_a_checkpoint_is_a_fence_between_them(relay, bus, job_id):
    """300 steps, a checkpoint, 100 steps from one rank, emitted at once: the relay has many steps on
    their way to the server, and the stream stores them in the rank's order, the checkpoint between."""
    r, ranks = relay
    zero = await link(r, job_id, 0, ranks.add(job_id, 0))
    for step in range(300):
        zero.emit(step_event(job_id, step))
    zero.emit(
        ev.CheckpointSaved(
            job_id=job_id, attempt=1, step=300, path=str(r.checkpoint_root / job_id / "step_00000300"),
            bytes=1, manifest_sha256="0", data_position=300,
        )
    )  # fmt: skip
    for step in range(300, 400):
        zero.emit(step_event(job_id, step))
    assert await asyncio.to_thread(zero.flush, 30.0)
    await asyncio.to_thread(zero.close)
    assert zero.dropped == 0 and zero.refused == 0 and zero.last_step == 399
    got = await stored_in_order(bus, job_id, 401)
    kinds = [e.step if isinstance(e, ev.StepCompleted) else e.type for e in got]
    assert kinds == [*range(300), "checkpoint.saved", *range(300, 400)]


async def test_a_new_attempts_commands_are_read_from_where_the_job_stands(relay, bus, job_id):
    """Attempt 1's commands are not read again for attempt 2; attempt 2's are numbered from 1, the same
    on a node whose read began before them and on one whose began after (which reads the job's all)."""
    r, ranks = relay
    for reason in ("one", "two", "three"):
        await bus.publish(subjects.cmd(job_id), ev.HaltJob(job_id=job_id, attempt=1, reason=reason))
    last_of_one = await bus.last_stored(subjects.COMMANDS.name, subjects.cmd(job_id))
    early = await link(r, job_id, 0, ranks.add(job_id, 0, attempt=2), attempt=2)
    try:
        halt = ev.HaltJob(job_id=job_id, attempt=2, reason="attempt two")
        await bus.publish(subjects.cmd(job_id), halt)
        assert (await asyncio.to_thread(early.command, 1, 10.0)).event_id == halt.event_id
        assert r.feeds[(job_id, 2)].read_from == last_of_one.seq + 1, "attempt 1's commands were read again"
        folder = Path(tempfile.mkdtemp(prefix="vigil-relay-"))
        other = await Relay(bus, "other-node", folder / "agent.sock", folder / "ckpt", ranks.find).start()
        try:
            late = await link(other, job_id, 1, ranks.add(job_id, 1, attempt=2), attempt=2)
            assert other.feeds[(job_id, 2)].read_from == 1  # this attempt's command is there: all of it
            assert (await asyncio.to_thread(late.command, 1, 10.0)).event_id == halt.event_id
            assert late.latest_seq == 1
            await asyncio.to_thread(late.close)
        finally:
            await other.close()
        assert early.latest_seq == 1
    finally:
        await asyncio.to_thread(early.close)


BATCH_S = 20.0  # long: a checkpoint that waited for the batch to close would show by seconds, not ms


async def test_fast_steps_go_out_in_batches_and_anything_else_or_a_gap_sends_at_once(relay, bus, job_id):
    """A step after a gap goes at once; steps that follow it fast wait (up to batch_s) to go out
    together; a checkpoint sends what waits before it, at once."""
    r, ranks = relay
    zero = await link(r, job_id, 0, ranks.add(job_id, 0), batch_s=BATCH_S)
    checkpoint = ev.CheckpointSaved(
        job_id=job_id, attempt=1, step=3, path=str(r.checkpoint_root / job_id / "step_00000003"), bytes=1,
        manifest_sha256="0", data_position=3,
    )  # fmt: skip
    try:
        async with bus.watch(subjects.step(job_id, NODE), subjects.status(job_id, NODE)) as stream:
            zero.emit(step_event(job_id, 0))  # after a gap (the first): at once
            first = await asyncio.wait_for(anext(stream), 10)
            t0 = time.monotonic()
            zero.emit(step_event(job_id, 1))
            zero.emit(step_event(job_id, 2))
            with pytest.raises(TimeoutError):  # held for the batch
                await asyncio.wait_for(anext(stream), 0.3)
            zero.emit(checkpoint)  # not a step: it and what waits before it go now
            rest = [await asyncio.wait_for(anext(stream), 10) for _ in range(3)]
            # long before the batch would close (a wide margin for a loaded machine)
            assert time.monotonic() - t0 < BATCH_S / 2, "the checkpoint waited for the batch to close"
    finally:
        await asyncio.to_thread(zero.close)
    assert first.step == 0  # (the two subjects are read apart: the stream's order is the test above's)
    assert sorted(e.step for e in rest if isinstance(e, ev.StepCompleted)) == [1, 2]
    assert [e.type for e in rest if not isinstance(e, ev.StepCompleted)] == ["checkpoint.saved"]
