"""A rank's reports are bounded at its agent's relay: a flood, an out-of-bounds report and a frame too
large from a hostile rank beside a victim's ranks on the same relay (worker n1's, with its own NATS
user). The hostile rank gets each refusal as its reply, naming the field; the guardian hears of them at
most once per field; every one of the victim's steps reaches the bus."""

from __future__ import annotations

import asyncio
import json
import secrets
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import pytest

from tests.helpers import step_completed
from vigil import events as ev
from vigil import protocol as proto
from vigil.link import AgentLink
from vigil_common import credentials, subjects
from vigil_common.bus import Bus
from vigil_worker.procs import RankRecord
from vigil_worker.relay import Relay

pytestmark = [pytest.mark.integration, pytest.mark.security]

NODE = "n1"
VICTIM_STEPS = 300
FLOOD = 20_000
RATE, BURST = 500.0, 1000  # the relay's per-rank bound here


def step_event(job_id: str, k: int, rank: int) -> ev.StepCompleted:
    return step_completed(job_id, k, rank, loss=1.0, node=NODE)


class Ranks:
    """The ranks the agent started (its RankTable's view), with their tokens and their job's size."""

    def __init__(self) -> None:
        self.records: dict[tuple[str, int, int], RankRecord] = {}

    def add(self, job_id: str, rank: int, world_size: int) -> proto.Hello:
        token = secrets.token_urlsafe(32)
        self.records[(job_id, 1, rank)] = RankRecord(
            job_id=job_id, attempt=1, rank=rank, device=rank, pid=1, ticks=1, log_path="", exit_path="",
            token=token, world_size=world_size,
        )  # fmt: skip
        return proto.Hello(job_id=job_id, attempt=1, rank=rank, token=token)

    def find(self, job_id: str, attempt: int, rank: int) -> RankRecord | None:
        return self.records.get((job_id, attempt, rank))


async def raw_link(path: Path, hello: proto.Hello) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    """A hostile program's own client of the socket (no SDK): hello, welcomed."""
    reader, writer = await asyncio.open_unix_connection(str(path), limit=proto.MAX_FRAME_BYTES + 1)
    writer.write(proto.encode_frame(hello))
    await writer.drain()
    assert isinstance(proto.decode_agent_frame(await reader.readline()), proto.Welcome)
    return reader, writer


async def answer(reader: asyncio.StreamReader) -> proto.Acked | proto.Refused:
    while True:
        frame = proto.decode_agent_frame(await asyncio.wait_for(reader.readline(), 10))
        if isinstance(frame, proto.Acked | proto.Refused):
            return frame


async def test_a_flood_an_out_of_bounds_report_and_a_huge_frame_cost_the_victim_nothing(
    connect: Callable[[str], Awaitable[Bus]], admin: Bus, job_id: str
) -> None:
    worker = await connect(credentials.worker_role(NODE))
    ranks = Ranks()
    victim, hostile = job_id, f"{job_id}-hostile"
    folder = Path(tempfile.mkdtemp(prefix="vigil-relay-"))
    relay = await Relay(
        worker,
        NODE,
        folder / "agent.sock",
        folder / "checkpoints",
        ranks.find,
        events_per_s=RATE,
        burst=BURST,
    ).start()
    victims = [ranks.add(victim, r, world_size=2) for r in (0, 1)]
    attacker = ranks.add(hostile, 0, world_size=1)
    links: list[AgentLink] = []
    try:
        async with (
            admin.watch(subjects.job_steps(victim)) as victim_steps,
            admin.watch(subjects.status(hostile, NODE)) as reports,
        ):
            for hello in victims:
                links.append(await asyncio.to_thread(AgentLink(relay.socket_path, hello).start, 10.0))
            flooder = await asyncio.to_thread(
                AgentLink(relay.socket_path, attacker, queue_size=FLOOD).start, 10.0
            )
            links.append(flooder)

            # 1. a report out of bounds: a culprit outside the job's one rank, then 5,000 culprits
            reader, writer = await raw_link(relay.socket_path, attacker)
            outside = ev.StepReplayed(
                job_id=hostile, attempt=1, step=1, node=NODE, kind="nan", outcome="transient", culprits=[5],
                values=[], data_position=1, held_s=0.1,
            )  # fmt: skip
            writer.write(proto.encode_frame(proto.Publish(id=1, event=outside)))
            first = await answer(reader)
            frame = json.loads(proto.Publish(id=2, event=outside).model_dump_json())
            frame["event"]["culprits"] = list(range(5000))
            writer.write(json.dumps(frame).encode() + b"\n")
            second = await answer(reader)
            # 2. a frame over the bound: refused, and the link closed
            writer.write(b'{"frame": "publish", "id": 3, "event": {"x": "' + b"y" * 200_000 + b'"}}\n')
            third = await answer(reader)
            writer.close()

            # 3. the flood, while the victim's ranks report their steps
            t0 = time.monotonic()
            for k in range(FLOOD):
                flooder.emit(step_event(hostile, k, 0))
            for k in range(VICTIM_STEPS):
                for rank, link in enumerate(links[:2]):
                    link.emit(step_event(victim, k, rank))
            for link in links:
                assert await asyncio.to_thread(link.flush, 60.0)
            flood_s = time.monotonic() - t0
            got = [await asyncio.wait_for(anext(victim_steps), 10) for _ in range(2 * VICTIM_STEPS)]
            assert sorted((e.rank, e.step) for e in got) == [
                (r, k) for r in (0, 1) for k in range(VICTIM_STEPS)
            ], "every victim step reached the bus"
            assert all(link.refused == 0 and link.dropped == 0 for link in links[:2])
            published = FLOOD - flooder.refused
            assert flooder.refused > 0 and "over the rate" in (flooder.last_refusal or "")
            assert published <= BURST + RATE * flood_s + 1, (published, flood_s)

            # the guardian's view: one report per field, the flood's counted into one
            seen: dict[str, ev.ReportRefused] = {}
            while (fact := await reports.next(2)) is not None:
                if isinstance(fact, ev.ReportRefused):
                    assert fact.field not in seen, f"a second report of {fact.field} within 30 s"
                    seen[fact.field] = fact
    finally:
        for link in links:
            await asyncio.to_thread(link.close)
        await relay.close()
    assert isinstance(first, proto.Acked) and "culprits.0: rank 5 is not a rank of this job" in (
        first.error or ""
    )
    assert isinstance(second, proto.Acked) and "culprits: List should have at most 1024 items" in (
        second.error or ""
    )
    assert isinstance(third, proto.Refused) and f"over {proto.MAX_RANK_FRAME_BYTES} bytes" in third.reason
    assert set(seen) == {"rate", "culprits.0", "culprits", "frame"}, seen
    assert seen["rate"].refused == 1  # the first; the rest are counted into the next report, if any
