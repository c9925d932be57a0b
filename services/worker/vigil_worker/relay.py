"""The agent's side of its ranks' links: the only way a rank reaches the bus.

Ranks hold no bus credential. The agent listens on a Unix socket that every local user may connect to
(0666, in a 0711 folder apart from the worker's state), since each job's ranks run as a user of its own;
a rank says who it is with the token the agent minted when it started that rank (`RankRecord.token`),
which stops working once the rank has exited, and the kernel says which uid connected (SO_PEERCRED):
that must be the uid the agent started that rank as. A stolen token is of no use to another job. From
then on:

- every event the rank sends (`protocol.FromRanks`) is checked against that identity (its job, attempt
  and rank; the node is the agent's own; only rank 0 reports job-wide facts; a checkpoint lies in the
  job's own folder), published on this node's subjects (the only ones the agent's NATS user may publish
  on), and acknowledged once stored, in the order sent. Steps are pipelined: up to `IN_FLIGHT` of a
  link's are on their way to the server at once, handed to the connection in order (so stored in
  order); any other event (a checkpoint, a rollback done, ...) is a fence: it goes once everything
  before it is stored, and what comes after it, once it is;
- what a rank sends is bounded: a frame's size (`protocol.MAX_RANK_FRAME_BYTES`), every field of its
  event (the event models' bounds, and the ranks it names lie within the job's world size) and its rate
  (`refusals.TokenBucket`). A refused event is answered with its reason, the link goes on, and the
  guardian hears of it (`ReportRefused`, at most one per job and field every `REPORT_EVERY_S`);
- the job's commands for ranks (`protocol.ToRanks`) of the rank's attempt, read from the command stream
  where the job stands (`CommandFeed`), go to every rank of that attempt here, numbered in stream order.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging
import os
import socket
import struct
from collections import deque
from collections.abc import Callable
from pathlib import Path
from typing import Any

from pydantic import TypeAdapter, ValidationError

from vigil import events as ev
from vigil import protocol as proto
from vigil.errors import CheckpointError, MalformedMessage
from vigil.manifest import confine
from vigil_common import subjects
from vigil_common.bus import Bus
from vigil_worker.command_feed import CommandFeed
from vigil_worker.procs import RankRecord
from vigil_worker.refusals import BURST, EVENTS_PER_S, REPORT_EVERY_S, RefusalReports, TokenBucket

log = logging.getLogger("vigil.worker")

IN_FLIGHT = 64  # a link's steps on their way to the server at once; then its frames wait to be read

Answer = str | None | asyncio.Future[Any]  # a refusal, stored, or a publish on its way


# --- a rank's frames ------------------------------------------------------------------------------------

_RANK_FRAME: TypeAdapter[proto.Hello | proto.Publish | proto.Bye] = TypeAdapter(proto.RankFrame)


class EventRefused(MalformedMessage):
    """A well-formed publish frame whose event breaks its model's bounds: refused, the link goes on.
    `field` is the first field named (the event's own path, e.g. `culprits` or `values.0.rank`)."""

    def __init__(self, id: int, report: str, field: str, reason: str) -> None:
        self.id, self.report, self.field, self.reason = id, report, field, reason
        super().__init__(reason)


def decode_rank_frame(line: bytes) -> proto.Hello | proto.Publish | proto.Bye:
    """A frame a rank sent; EventRefused for a publish frame whose event is out of bounds (answer it
    and go on), MalformedMessage naming the field for anything else that is wrong."""
    if len(line) > proto.MAX_RANK_FRAME_BYTES:
        raise MalformedMessage(f"frame of {len(line)} bytes exceeds {proto.MAX_RANK_FRAME_BYTES}")
    try:
        return _RANK_FRAME.validate_json(line)
    except ValidationError as exc:
        if (older := _older_step(line)) is not None:
            return older
        if (refused := _refused_event(exc, line)) is not None:
            raise refused from exc
        raise MalformedMessage(f"bad frame: {proto.bad_fields(exc)}") from exc


def _older_step(line: bytes) -> proto.Publish | None:
    """A publish frame of a StepCompleted of an older version (a training image with an older SDK), read
    as the current version, as `events.decode` reads it from the bus; None for anything else (off the
    hot path: only a frame the current models refused gets here)."""
    with contextlib.suppress(ValueError):  # not JSON, or the older version refuses it too
        frame = json.loads(line)
        event = frame.get("event") if isinstance(frame, dict) and frame.get("frame") == "publish" else None
        if isinstance(event, dict) and event.get("type") == "step.completed":
            older = ev.REGISTRY.get(("step.completed", event.get("schema_version")))  # type: ignore[arg-type]
            if older is not None and older is not ev.StepCompleted:
                return proto.Publish(id=frame.get("id"), event=older.model_validate(event).upgraded())
    return None


def _refused_event(exc: ValidationError, line: bytes) -> EventRefused | None:
    """The refusal of a publish frame whose every error lies inside its event (its id is good)."""
    errors = exc.errors(include_url=False)
    if not all(e["loc"][:2] == ("publish", "event") and len(e["loc"]) > 3 for e in errors):
        return None
    frame = json.loads(line)  # valid JSON with a valid id: the errors are all inside the event
    report = str(errors[0]["loc"][2])
    field = ".".join(str(p) for p in errors[0]["loc"][3:])
    parts = ["{}: {}".format(".".join(str(p) for p in e["loc"][3:]), e["msg"]) for e in errors[:5]]
    return EventRefused(frame["id"], report, field, f"{report} refused: " + "; ".join(parts))


class Acks:
    """A link's answers, written in the order its events came: each an error now, or a publish still
    on its way. What is answered together goes out in one write."""

    def __init__(self, writer: asyncio.StreamWriter, who: str, in_flight: int = IN_FLIGHT) -> None:
        self.writer, self.who = writer, who
        self._pending: deque[tuple[int, Answer]] = deque()
        self._room = asyncio.Semaphore(in_flight)
        self._more = asyncio.Event()
        self._idle = asyncio.Event()
        self._idle.set()
        self._task = asyncio.create_task(self._answer(), name="acks")

    async def put(self, event_id: int, answer: Answer) -> None:
        """Answer `event_id` with `answer` (None: stored) once everything before it is answered; waits
        while `IN_FLIGHT` are unanswered."""
        self._check()
        await self._room.acquire()
        self._pending.append((event_id, answer))
        self._idle.clear()
        self._more.set()

    async def settled(self) -> None:
        """Return once every answer so far is written."""
        await self._idle.wait()
        self._check()

    async def close(self) -> None:
        self._task.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await self._task
        for _, answer in self._pending:  # stored or not: the rank sends it again on its next link
            if isinstance(answer, asyncio.Future):
                answer.cancel()

    def _outcome(self, published: asyncio.Future[Any]) -> str | None:
        """None once stored, else why not."""
        if published.cancelled():
            return "not published: cancelled"
        if (exc := published.exception()) is None:
            return None
        log.warning("publishing a step from %s failed: %s", self.who, exc)
        return f"not published: {exc}"

    def _check(self) -> None:
        if self._task.done():  # the writer failed: the link is gone
            self._task.result()
            raise ConnectionError("the link's answers stopped")

    async def _answer(self) -> None:
        try:
            while True:
                while not self._pending:
                    self._more.clear()
                    await self._more.wait()
                head = self._pending[0][1]
                if isinstance(head, asyncio.Future):
                    await asyncio.wait({head})
                frames = []
                while self._pending:  # the head, and whatever after it is answered already: one write
                    event_id, answer = self._pending[0]
                    if isinstance(answer, asyncio.Future):
                        if not answer.done():
                            break
                        answer = self._outcome(answer)
                    self._pending.popleft()
                    frames.append(proto.encode_frame(proto.Acked(id=event_id, error=answer)))
                self.writer.write(b"".join(frames))
                await self.writer.drain()
                for _ in frames:
                    self._room.release()
                if not self._pending:
                    self._idle.set()
        finally:
            self._idle.set()  # nobody waits on a link that is gone


class Relay:
    """Serves the ranks' links on `socket_path`; `find` gives the running rank a hello names."""

    def __init__(
        self,
        bus: Bus,
        node: str,
        socket_path: Path,
        checkpoint_root: Path,
        find: Callable[[str, int, int], RankRecord | None],
        *,
        events_per_s: float = EVENTS_PER_S,
        burst: int = BURST,
        report_every_s: float = REPORT_EVERY_S,
    ) -> None:
        self.bus, self.node, self.socket_path = bus, node, socket_path
        self.checkpoint_root = checkpoint_root
        self.find = find
        self.feeds: dict[tuple[str, int], CommandFeed] = {}  # by job and attempt
        self.refused = 0  # events refused (logged), for tests and metrics
        self.events_per_s, self.burst = events_per_s, burst
        self.reports = RefusalReports(report_every_s)
        self._buckets: dict[tuple[str, int, int], TokenBucket] = {}  # per rank, its links together
        self._server: asyncio.Server | None = None

    async def start(self) -> Relay:
        self.socket_path.parent.mkdir(parents=True, exist_ok=True)
        os.chmod(self.socket_path.parent, 0o711)  # jobs' users reach the socket and list nothing
        self.socket_path.unlink(missing_ok=True)  # a previous agent's
        self._server = await asyncio.start_unix_server(
            self._serve, path=str(self.socket_path), limit=proto.MAX_RANK_FRAME_BYTES + 1
        )
        os.chmod(self.socket_path, 0o666)  # who may speak for a rank is the hello's token and peer uid
        return self

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._server.wait_closed(), 5)
        for feed in list(self.feeds.values()):
            await feed.stop()
        self.feeds.clear()

    # --- one rank's link -------------------------------------------------------------------------------

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        hello: proto.Hello | None = None
        delivering: asyncio.Task[None] | None = None
        acks: Acks | None = None
        try:
            welcomed = await self._welcome(reader, writer)
            if welcomed is None:
                return
            hello, welcome = welcomed
            feed = await self._feed(hello)  # reading the commands before the rank is welcomed
            writer.write(proto.encode_frame(welcome))
            await writer.drain()
            delivering = asyncio.create_task(feed.deliver(writer.write))
            acks = Acks(writer, _who(hello))
            while line := await self._line(hello, reader):
                try:
                    frame = decode_rank_frame(line)
                except EventRefused as exc:  # out of its model's bounds: answered, the link goes on
                    await self._refuse(hello, exc.report, exc.field, exc.reason)
                    await acks.put(exc.id, exc.reason[:2000])
                    continue
                match frame:
                    case proto.Publish(id=event_id, event=event):
                        await acks.put(event_id, await self._publish(hello, event, acks))
                    case proto.Bye():
                        await acks.settled()  # every answer out before the link closes
                        break
                    case proto.Hello():
                        raise MalformedMessage("a second hello on one link")
        except MalformedMessage as exc:
            log.warning("rank link %s: %s; closing it", _who(hello), exc)
            with contextlib.suppress(Exception):
                writer.write(proto.encode_frame(proto.Refused(reason=str(exc)[:500])))
        except (ConnectionError, asyncio.IncompleteReadError, ValueError) as exc:
            log.info("rank link %s closed: %s", _who(hello), exc)
        finally:
            if acks is not None:
                await acks.close()
            if delivering is not None:
                delivering.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await delivering
            if hello is not None:
                await self._release(hello)
            writer.close()
            with contextlib.suppress(Exception):
                await writer.wait_closed()

    async def _line(self, hello: proto.Hello, reader: asyncio.StreamReader) -> bytes:
        """The rank's next frame; a longer one than MAX_RANK_FRAME_BYTES is refused, closing the link."""
        try:
            return await reader.readline()
        except ValueError as exc:  # asyncio's LimitOverrunError: the line is over the reader's limit
            why = f"a frame over {proto.MAX_RANK_FRAME_BYTES} bytes"
            await self._refuse(hello, "frame", "frame", why)
            raise MalformedMessage(why) from exc

    async def _welcome(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> tuple[proto.Hello, proto.Welcome] | None:
        """The rank's hello and the welcome to answer it with (sent once its commands are being read), or
        None once it is refused."""
        frame = decode_rank_frame(await reader.readline())
        if not isinstance(frame, proto.Hello):
            raise MalformedMessage(f"the first frame must be a hello, not {frame.frame!r}")
        record = self.find(frame.job_id, frame.attempt, frame.rank)
        peer = peer_uid(writer)
        if (
            record is None
            or not frame.token  # only a rank pod's first hello has none (`pod_relay`), never one here
            or not hmac.compare_digest(record.token.encode(), frame.token.encode())
            or peer != (os.geteuid() if record.uid is None else record.uid)
        ):
            log.warning("refused a link from uid %s claiming to be %s: no running rank of that user with "
                        "that token", peer, _who(frame))  # fmt: skip
            writer.write(proto.encode_frame(proto.Refused(reason="no running rank with that identity")))
            await writer.drain()
            return None
        return frame, proto.Welcome(node=self.node)

    async def _feed(self, hello: proto.Hello) -> CommandFeed:
        key = (hello.job_id, hello.attempt)
        feed = self.feeds.get(key)
        if feed is None:
            feed = self.feeds[key] = CommandFeed(self.bus, *key)
            await feed.start()
        feed.users += 1
        return feed

    async def _release(self, hello: proto.Hello) -> None:
        key = (hello.job_id, hello.attempt)
        feed = self.feeds.get(key)
        if feed is not None:
            feed.users -= 1
            if feed.users <= 0:  # the attempt's last link here: its ranks' rates go with it
                del self.feeds[key]
                for bucket in [k for k in self._buckets if k[:2] == key]:
                    del self._buckets[bucket]
                if not any(job == hello.job_id for job, _ in self.feeds):  # and the job's last: its counts
                    self.reports.forget(hello.job_id)
                await feed.stop()

    # --- one event -------------------------------------------------------------------------------------

    async def _publish(self, hello: proto.Hello, event: ev.Message, acks: Acks) -> Answer:
        """Publish `event` for the rank `hello` names: the reason it is refused; or, for a step, its
        publish on its way (None once stored); for any other event, once everything `acks` holds before
        it is stored, None once it is stored too."""
        key = (hello.job_id, hello.attempt, hello.rank)
        bucket = self._buckets.get(key)
        if bucket is None:
            bucket = self._buckets[key] = TokenBucket(self.events_per_s, self.burst)
        refused: tuple[str, str] | None
        if not bucket.take():
            refused = "rate", f"over the rate of {self.events_per_s:g} events/s (burst {self.burst}) per rank"
        else:
            refused = self.refusal(hello, event)
        if refused is not None:
            field, why = refused
            await self._refuse(hello, event.type, field, why)
            return why
        job = hello.job_id
        subject = (
            subjects.step(job, self.node)
            if isinstance(event, ev.StepCompleted)
            else subjects.status(job, self.node)
        )
        if isinstance(event, ev.StepCompleted):
            try:
                return await self.bus.publish_pipelined(subject, event)
            except Exception as exc:
                return self._not_published(hello, event, exc)
        await acks.settled()  # a fence: what came before is stored first
        try:
            await self.bus.publish(subject, event)
        except Exception as exc:
            return self._not_published(hello, event, exc)
        return None

    def _not_published(self, hello: proto.Hello, event: ev.Message, exc: Exception) -> str:
        log.warning("publishing %s from %s failed: %s", event.type, _who(hello), exc)
        return f"not published: {exc}"

    async def _refuse(self, hello: proto.Hello, report: str, field: str, why: str) -> None:
        """Count and log a refusal, and tell the guardian when one of this job's `field` is due."""
        self.refused += 1
        log.warning("refused %s from %s: %s", report, _who(hello), why)
        if not (count := self.reports.due(hello.job_id, field)):
            return
        fact = ev.ReportRefused(
            job_id=hello.job_id,
            attempt=hello.attempt,
            rank=hello.rank,
            node=self.node,
            report=report[:256],
            field=field[:256],
            reason=why[:4096].replace("\x00", ""),
            refused=count,
        )
        try:
            await self.bus.publish(subjects.status(hello.job_id, self.node), fact)
        except Exception as exc:  # the rank has its answer; the report is lost, and said so
            log.warning("reporting a refusal of %s failed: %s", _who(hello), exc)

    def refusal(self, hello: proto.Hello, event: ev.Message) -> tuple[str, str] | None:
        """(field, why) the rank `hello` names may not publish `event`; None when it may."""
        if event.job_id != hello.job_id:
            return "job_id", f"job_id {event.job_id!r} is not this rank's job {hello.job_id!r}"
        if event.attempt != hello.attempt:
            return "attempt", f"attempt {event.attempt} is not this rank's attempt {hello.attempt}"
        if (node := getattr(event, "node", self.node)) != self.node:
            return "node", f"node {node!r} is not this node {self.node!r}"
        if isinstance(event, ev.StepCompleted):
            if event.rank != hello.rank:
                return "rank", f"rank {event.rank} is not this link's rank {hello.rank}"
            return None
        if hello.rank != 0 and not isinstance(event, ev.CheckpointRefused):  # any rank may fail to load
            return "rank", f"{event.type} is reported by rank 0 only"
        if (outside := self._outside_the_job(hello, event)) is not None:
            return outside
        if isinstance(
            event, ev.CheckpointSaved | ev.CheckpointRefused | ev.RollbackCompleted | ev.RestartRequested
        ):
            path = (
                event.checkpoint
                if isinstance(event, ev.RollbackCompleted | ev.RestartRequested)
                else event.path
            )
            try:
                confine(self.checkpoint_root / hello.job_id, path)
            except (CheckpointError, ValueError) as exc:
                field = "path" if isinstance(event, ev.CheckpointSaved) else "checkpoint"
                return field, f"not a checkpoint of job {hello.job_id}: {exc}"
        return None

    def _outside_the_job(self, hello: proto.Hello, event: ev.Message) -> tuple[str, str] | None:
        """(field, why) when `event` names a rank the job does not have (its world size, where known)."""
        record = self.find(hello.job_id, hello.attempt, hello.rank)
        world = record.world_size if record is not None else 0
        if not world:
            return None  # not known (a rank a previous agent started): the model's bound holds
        named: list[tuple[str, int]] = []
        if isinstance(event, ev.StepReplayed):
            named = [(f"culprits.{i}", r) for i, r in enumerate(event.culprits)]
            named += [(f"values.{i}.rank", v.rank) for i, v in enumerate(event.values)]
        elif isinstance(event, ev.OutOfMemoryHalted):
            named = [("rank", event.rank)]
        for field, rank in named:
            if rank >= world:
                return field, f"{field}: rank {rank} is not a rank of this job (world size {world})"
        return None


def peer_uid(writer: asyncio.StreamWriter) -> int | None:
    """The uid of the process at the other end of a Unix socket (the kernel's word, SO_PEERCRED)."""
    sock = writer.get_extra_info("socket")
    try:
        _, uid, _ = struct.unpack("iII", sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12))
    except (AttributeError, OSError):
        return None
    return int(uid)


def _who(hello: proto.Hello | None) -> str:
    return (
        "an unidentified rank"
        if hello is None
        else f"rank {hello.rank} of {hello.job_id} attempt {hello.attempt}"
    )
