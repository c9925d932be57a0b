"""A rank's link to its worker agent: events out, the job's commands in.

`NullLink` (outside Vigil) drops events and never has commands, so a program runs alone.
`AgentLink` talks to the agent that started this rank over its Unix socket, or in a Kubernetes rank pod
over TCP to its node's worker (`vigil.protocol` frames), from a background thread with its own
asyncio loop: `emit` hands an event over and returns at once; the hand-over queue is bounded, and when it
is full the event is dropped and counted (never blocking the training loop). The thread is woken once for
whatever was handed over since it last looked, and sends it in one write: a step's event waits up to
`LINK_BATCH_S` (`VIGIL_LINK_BATCH_S`) to go out with the next ones, any other event goes at once with
what waits before it. Events go out in order and
each is acknowledged once the agent has it stored on the bus, or refused: an event out of bounds (a
field, its size, the rank's rate) comes back with the agent's reason, which the link logs as an error,
counts (`refused`) and keeps (`last_refusal`); an event too large to send is refused here the same way.
If the agent restarts, the link reconnects and sends again what was not acknowledged (the bus
de-duplicates by event id).

Commands arrive numbered 1, 2, ... in the job's stream order, the same numbers on every rank.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import os
import threading
import time
from collections import OrderedDict, deque
from pathlib import Path
from typing import Protocol

from vigil import events as ev
from vigil import protocol as proto

log = logging.getLogger("vigil.rank")

RECONNECT_FOR_S = 120.0  # how long a lost agent is waited for before events are dropped
# Steps that come faster than this go out together, a batch at most this long after its first (one
# write, one wake-up of the agent and of NATS for several steps); a step after a longer gap, any other
# event, a flush and a full batch go at once.
LINK_BATCH_S = 0.05


class Link(Protocol):
    dropped: int

    def emit(self, event: ev.Message) -> None: ...

    @property
    def latest_seq(self) -> int: ...

    def command(self, seq: int, timeout_s: float) -> proto.RankCommand: ...

    def arrival(self, seq: int) -> float | None: ...

    def flush(self, timeout_s: float = 30.0) -> bool: ...

    def close(self, timeout_s: float = 10.0) -> None: ...


class NullLink:
    """No agent: events vanish, no command ever arrives."""

    dropped = 0
    last_step: int | None = None

    def emit(self, event: ev.Message) -> None:
        pass

    @property
    def latest_seq(self) -> int:
        return 0

    def command(self, seq: int, timeout_s: float) -> proto.RankCommand:
        raise TimeoutError("no command source")

    def arrival(self, seq: int) -> float | None:
        return None

    def flush(self, timeout_s: float = 30.0) -> bool:
        return True

    def close(self, timeout_s: float = 10.0) -> None:
        pass


class AgentLink:
    """The rank side of the agent's socket, on a background thread with its own event loop."""

    def __init__(
        self,
        socket_path: str | Path,
        hello: proto.Hello,
        *,
        queue_size: int = 10_000,
        batch_s: float | None = None,
        batch_max: int = 64,
    ) -> None:
        self.socket_path, self.hello = str(socket_path), hello
        self.batch_s = batch_from_env() if batch_s is None else batch_s
        self.batch_max = batch_max
        self.node: str | None = None  # the agent's node, from its Welcome
        self.dropped = 0
        self.refused = 0  # events the agent would not publish (logged)
        self.last_refusal: str | None = None  # why the last one was refused
        self.last_step: int | None = None  # the last step the agent acknowledged
        self._queue_size = queue_size
        self._outbox: deque[tuple[int, ev.Message]] = deque()  # handed over, not yet sent (under _cond)
        self._woken = False  # the thread looks within batch_s without being woken again (under _cond)
        self._hurried = False  # ... and that it goes now (under _cond)
        self._last_step_at = -math.inf  # when the last step was handed over (time.monotonic())
        self._commands: list[proto.RankCommand] = []
        self._arrivals: list[float] = []  # time.monotonic() when each command reached this rank
        self._cond = threading.Condition()
        self._emitted = 0  # events handed over (the id of the last one)
        self._outstanding = 0  # handed over and not yet acknowledged, refused or dropped
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._wakeup: asyncio.Event | None = None  # something to send
        self._hurry: asyncio.Event | None = None  # ... now
        self._closing = False  # close() asked: send what is handed over, then say goodbye (under _cond)
        self._thread = threading.Thread(target=self._run, name="vigil-link", daemon=True)

    def start(self, timeout_s: float = 30.0) -> AgentLink:
        """Connect and be welcomed before returning (so no command of the job is missed)."""
        self._thread.start()
        if not self._ready.wait(timeout_s):
            raise TimeoutError(f"vigil: no answer from the agent at {self.socket_path} within {timeout_s}s")
        if self._error:
            raise self._error
        return self

    # --- called from the training thread ---------------------------------------------------------------

    def emit(self, event: ev.Message) -> None:
        """Queue an event for the agent; never blocks (a full queue drops and counts the event)."""
        if self._loop is None or self._loop.is_closed():
            return
        now = time.monotonic()
        with self._cond:
            if len(self._outbox) >= self._queue_size:
                self.dropped += 1
                if self.dropped & (self.dropped - 1) == 0:  # 1, 2, 4, 8, ...
                    log.warning("vigil link: queue full, %d events dropped so far", self.dropped)
                return
            self._emitted += 1
            self._outstanding += 1
            self._outbox.append((self._emitted, event))
            gather = False
            if isinstance(event, ev.StepCompleted):
                gather = now - self._last_step_at < self.batch_s and len(self._outbox) < self.batch_max
                self._last_step_at = now
            if gather and self._woken:
                return  # the thread looks within batch_s
            wake = not self._woken or not (gather or self._hurried)
            self._woken, self._hurried = True, self._hurried or not gather
        if wake:
            self._wake(hurry=not gather)

    @property
    def latest_seq(self) -> int:
        with self._cond:
            return len(self._commands)

    def command(self, seq: int, timeout_s: float) -> proto.RankCommand:
        """The command numbered `seq` (1-based), waiting up to `timeout_s` for it to arrive."""
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while len(self._commands) < seq:
                left = deadline - time.monotonic()
                if left <= 0 or not self._cond.wait(left):
                    raise TimeoutError(f"command #{seq} did not arrive within {timeout_s}s")
            return self._commands[seq - 1]

    def arrival(self, seq: int) -> float | None:
        """When command `seq` reached this rank (time.monotonic())."""
        with self._cond:
            return self._arrivals[seq - 1] if 0 < seq <= len(self._arrivals) else None

    def flush(self, timeout_s: float = 30.0) -> bool:
        """Wait until every event emitted so far is acknowledged; False after `timeout_s`."""
        deadline = time.monotonic() + timeout_s
        self._wake(hurry=True)  # what a batch holds goes now
        with self._cond:
            while self._outstanding > 0:
                left = deadline - time.monotonic()
                if left <= 0 or not self._cond.wait(left):
                    return False
        return True

    def close(self, timeout_s: float = 10.0) -> None:
        """Send what is queued (up to `timeout_s`), say goodbye, disconnect."""
        if self._loop is not None and self._thread.is_alive():
            with self._cond:
                self._closing = True
            self._wake(hurry=True)
            self._thread.join(timeout_s)
        if self.dropped or self.refused:
            log.warning("vigil link: %d events dropped (queue full), %d refused", self.dropped, self.refused)

    # --- the background thread -------------------------------------------------------------------------

    def _settle(self) -> None:
        """One handed-over event is done with (acknowledged, refused or dropped)."""
        with self._cond:
            self._outstanding -= 1
            self._cond.notify_all()

    def _refused(self, event: ev.Message | None, why: str) -> None:
        self.refused += 1
        self.last_refusal = why
        log.error("vigil link: the agent refused %s: %s", getattr(event, "type", "?"), why)

    def _wake(self, hurry: bool) -> None:
        """Tell the thread there is something to send; with `hurry`, to send it now."""
        loop = self._loop
        if loop is None:
            return
        with contextlib.suppress(RuntimeError):  # the loop closed meanwhile: nothing is sent any more
            loop.call_soon_threadsafe(self._set, hurry)

    def _set(self, hurry: bool) -> None:
        assert self._wakeup is not None and self._hurry is not None
        self._wakeup.set()
        if hurry:
            self._hurry.set()

    def _take(self) -> tuple[list[tuple[int, ev.Message]], bool, bool]:
        """What was handed over since the last look, whether close() was asked, and whether to look again
        within batch_s without being woken (something came: more may come as fast)."""
        assert self._wakeup is not None and self._hurry is not None
        self._wakeup.clear()
        self._hurry.clear()
        with self._cond:
            items = list(self._outbox)
            self._outbox.clear()
            self._hurried = False
            self._woken = bool(items) and self.batch_s > 0  # woken: emit need not wake it for a step
            return items, self._closing, self._woken

    def _run(self) -> None:
        try:
            asyncio.run(self._main())
        except BaseException as exc:  # reported to start() or logged; the training thread goes on
            if not self._ready.is_set():
                self._error = exc
                self._ready.set()
            else:
                log.exception("vigil link: background thread failed")

    async def _main(self) -> None:
        self._wakeup, self._hurry = asyncio.Event(), asyncio.Event()
        self._loop = asyncio.get_running_loop()
        unacked: OrderedDict[int, ev.Message] = OrderedDict()  # sent, not yet acknowledged
        lost_since: float | None = None
        while True:
            try:
                reader, writer = await _open(self.socket_path)
            except OSError as exc:
                if not self._ready.is_set():
                    raise ConnectionError(
                        f"vigil: cannot reach the agent at {self.socket_path}: {exc}"
                    ) from exc
                lost_since = lost_since or time.monotonic()
                if time.monotonic() - lost_since > RECONNECT_FOR_S:
                    log.error(
                        "vigil link: agent gone for %.0fs; %d events lost", RECONNECT_FOR_S, len(unacked)
                    )
                    return
                await asyncio.sleep(0.5)  # the agent is restarting: try again
                continue
            lost_since = None
            try:
                done = await self._session(reader, writer, unacked)
            finally:
                writer.close()
                with contextlib.suppress(Exception):
                    await writer.wait_closed()
            if done:
                return

    async def _session(
        self,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        unacked: OrderedDict[int, ev.Message],
    ) -> bool:
        """One connection: hello, then commands in and events out. True once closed for good."""
        writer.write(proto.encode_frame(self.hello))
        await writer.drain()
        first = proto.decode_agent_frame(await reader.readline())
        match first:
            case proto.Welcome(node=node, token=token):
                self.node = node
                if token:  # a rank pod's first link: the agent minted this rank's token
                    self.hello = self.hello.model_copy(update={"token": token})
            case proto.Refused(reason=reason):
                raise PermissionError(f"vigil: the agent refused this rank: {reason}")
            case _:
                raise ConnectionError(f"vigil: the agent answered {first.frame!r} to hello")
        self._ready.set()
        receiver = asyncio.create_task(self._receive(reader, unacked))
        try:
            for event_id, event in list(unacked.items()):  # what the last connection left unacknowledged
                writer.write(proto.encode_frame(proto.Publish(id=event_id, event=event)))
            await writer.drain()
            assert self._wakeup is not None and self._hurry is not None
            looking = False  # steps are coming fast: look again batch_s after the last look, unwoken
            while True:
                if not looking and not await self._until(self._wakeup, receiver):
                    return False
                if not self._hurry.is_set() and not await self._until(self._hurry, receiver, self.batch_s):
                    return False  # a batch is open: it goes when hurried or batch_s after it opened
                items, closing, looking = self._take()
                frames = []
                for event_id, event in items:
                    frame = proto.encode_frame(proto.Publish(id=event_id, event=event))
                    if len(frame) > proto.MAX_RANK_FRAME_BYTES:  # the agent would refuse it, closing the link
                        self._refused(event, f"{len(frame)} bytes, over {proto.MAX_RANK_FRAME_BYTES} a frame")
                        self._settle()
                        continue
                    unacked[event_id] = event
                    frames.append(frame)
                if frames:
                    writer.write(b"".join(frames))
                    await writer.drain()
                if closing:  # say goodbye once everything handed over before close() is sent
                    writer.write(proto.encode_frame(proto.Bye()))
                    await writer.drain()
                    await receiver  # the agent acks what it holds, then closes
                    return True
        except (ConnectionError, OSError):
            return False
        finally:
            receiver.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await receiver

    async def _until(
        self, event: asyncio.Event, receiver: asyncio.Task[None], timeout_s: float | None = None
    ) -> bool:
        """Wait for `event` (up to `timeout_s`); False when the agent went away meanwhile."""
        waiting = asyncio.ensure_future(event.wait())
        finished, _ = await asyncio.wait(
            {waiting, receiver}, timeout=timeout_s, return_when=asyncio.FIRST_COMPLETED
        )
        waiting.cancel()
        if receiver in finished:
            receiver.result()
            return False
        return True

    async def _receive(self, reader: asyncio.StreamReader, unacked: OrderedDict[int, ev.Message]) -> None:
        while line := await reader.readline():
            match proto.decode_agent_frame(line):
                case proto.Delivered(seq=seq, command=command):
                    with self._cond:
                        if seq == len(self._commands) + 1:  # a reconnect replays from 1: keep the new ones
                            self._commands.append(command)
                            self._arrivals.append(time.monotonic())
                            self._cond.notify_all()
                case proto.Acked(id=event_id, error=error):
                    event = unacked.pop(event_id, None)
                    if error is not None:
                        self._refused(event, error)
                    elif isinstance(event, ev.StepCompleted):
                        self.last_step = event.step
                    if event is not None:
                        self._settle()
                case proto.Refused(reason=reason):
                    log.error("vigil link: the agent closed the link: %s", reason)
                    return
                case proto.Welcome():
                    pass


def batch_from_env() -> float:
    """How long a step's event may wait to go out with the next ones (`VIGIL_LINK_BATCH_S`, seconds; 0:
    each at once)."""
    text = os.environ.get(proto.LINK_BATCH_ENV)
    if not text:
        return LINK_BATCH_S
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not 0 <= value <= 5:
        raise ValueError(f"{proto.LINK_BATCH_ENV}={text!r}: a number of seconds from 0 to 5")
    return value


async def _open(address: str) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    """Connect to the agent: a Unix socket's path, or tcp://HOST:PORT (a rank pod's worker relay)."""
    if address.startswith("tcp://"):
        host, _, port = address.removeprefix("tcp://").rpartition(":")
        return await asyncio.open_connection(host.strip("[]"), int(port), limit=proto.MAX_FRAME_BYTES + 1)
    return await asyncio.open_unix_connection(address, limit=proto.MAX_FRAME_BYTES + 1)


def connect_from_env(job_id: str, attempt: int, rank: int) -> AgentLink | None:
    """The link the worker set up for this rank (VIGIL_AGENT_SOCKET, and the token on the pipe that
    VIGIL_RANK_TOKEN_FD names), or None. A rank pod has no token: its agent (tcp://) admits its first
    link by the pod's IP and mints one (`Welcome.token`)."""
    path, token = os.environ.get(proto.AGENT_SOCKET_ENV), rank_token() or ""
    if not path or not (token or path.startswith("tcp://")):
        return None
    hello = proto.Hello(job_id=job_id, attempt=attempt, rank=rank, token=token)
    return AgentLink(path, hello).start()


_token: str | None = None


def rank_token() -> str | None:
    """This rank's token, read once from the pipe the worker handed it (the descriptor is closed and its
    variable dropped then, so no process the rank starts inherits either); None outside Vigil. A rank
    handed its job's next attempt in its process (`vigil_trainer.park`) gets a new pipe: read then."""
    global _token
    if fd := os.environ.pop(proto.RANK_TOKEN_FD_ENV, None):
        try:
            with os.fdopen(int(fd), "rb") as pipe:
                _token = pipe.read(4096).decode().strip() or None
        except (OSError, ValueError) as exc:
            log.error("vigil: no rank token on descriptor %s (%s): reporting is off", fd, exc)
    return _token
