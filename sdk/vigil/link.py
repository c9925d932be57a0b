"""A rank's link to its worker agent: events out, the job's commands in.

`NullLink` (outside Vigil) drops events and never has commands, so a program runs alone.
`AgentLink` talks to the agent that started this rank over its Unix socket, or in a Kubernetes rank pod
over TCP to its node's worker (`vigil.protocol` frames), from a background thread with its own
asyncio loop: `emit` hands an event over and returns at once; the hand-over queue is bounded, and when it
is full the event is dropped and counted (never blocking the training loop). Events go out in order and
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
import os
import threading
import time
from collections import OrderedDict
from pathlib import Path
from typing import Protocol

from vigil import events as ev
from vigil import protocol as proto

log = logging.getLogger("vigil.rank")

RECONNECT_FOR_S = 120.0  # how long a lost agent is waited for before events are dropped


class Link(Protocol):
    dropped: int

    def emit(self, event: ev.Message) -> None: ...

    @property
    def latest_seq(self) -> int: ...

    def command(self, seq: int, timeout_s: float) -> ev.Message: ...

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

    def command(self, seq: int, timeout_s: float) -> ev.Message:
        raise TimeoutError("no command source")

    def arrival(self, seq: int) -> float | None:
        return None

    def flush(self, timeout_s: float = 30.0) -> bool:
        return True

    def close(self, timeout_s: float = 10.0) -> None:
        pass


class AgentLink:
    """The rank side of the agent's socket, on a background thread with its own event loop."""

    def __init__(self, socket_path: str | Path, hello: proto.Hello, *, queue_size: int = 10_000) -> None:
        self.socket_path, self.hello = str(socket_path), hello
        self.node: str | None = None  # the agent's node, from its Welcome
        self.dropped = 0
        self.refused = 0  # events the agent would not publish (logged)
        self.last_refusal: str | None = None  # why the last one was refused
        self.last_step: int | None = None  # the last step the agent acknowledged
        self._queue_size = queue_size
        self._commands: list[ev.Message] = []
        self._arrivals: list[float] = []  # time.monotonic() when each command reached this rank
        self._cond = threading.Condition()
        self._emitted = 0  # events handed over (the id of the last one)
        self._outstanding = 0  # handed over and not yet acknowledged, refused or dropped
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._queue: asyncio.Queue[tuple[int, ev.Message] | None] | None = None
        self._closing = False
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
        with self._cond:
            self._emitted += 1
            self._outstanding += 1
            item = (self._emitted, event)
        try:
            self._loop.call_soon_threadsafe(self._put, item)
        except RuntimeError:  # the loop closed meanwhile
            self._settle()

    @property
    def latest_seq(self) -> int:
        with self._cond:
            return len(self._commands)

    def command(self, seq: int, timeout_s: float) -> ev.Message:
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
        with self._cond:
            while self._outstanding > 0:
                left = deadline - time.monotonic()
                if left <= 0 or not self._cond.wait(left):
                    return False
        return True

    def close(self, timeout_s: float = 10.0) -> None:
        """Send what is queued (up to `timeout_s`), say goodbye, disconnect."""
        if self._loop is not None and self._thread.is_alive():
            with contextlib.suppress(RuntimeError):
                self._loop.call_soon_threadsafe(self._put, None)
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

    def _put(self, item: tuple[int, ev.Message] | None) -> None:
        assert self._queue is not None
        if item is None:
            self._closing = True
            with contextlib.suppress(asyncio.QueueFull):
                self._queue.put_nowait(None)
            return
        try:
            self._queue.put_nowait(item)
        except asyncio.QueueFull:
            self.dropped += 1
            self._settle()
            if self.dropped & (self.dropped - 1) == 0:  # 1, 2, 4, 8, ...
                log.warning("vigil link: queue full, %d events dropped so far", self.dropped)

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
        self._loop = asyncio.get_running_loop()
        self._queue = asyncio.Queue(self._queue_size)
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
            assert self._queue is not None
            while True:
                get = asyncio.ensure_future(self._queue.get())
                finished, _ = await asyncio.wait({get, receiver}, return_when=asyncio.FIRST_COMPLETED)
                if receiver in finished:  # the agent went away
                    get.cancel()
                    receiver.result()
                    return False
                item = get.result()
                if item is None:  # closing: say goodbye once everything queued before it is sent
                    writer.write(proto.encode_frame(proto.Bye()))
                    await writer.drain()
                    await receiver  # the agent acks what it holds, then closes
                    return True
                event_id, event = item
                frame = proto.encode_frame(proto.Publish(id=event_id, event=event))
                if len(frame) > proto.MAX_RANK_FRAME_BYTES:  # the agent would refuse it and close the link
                    self._refused(event, f"{len(frame)} bytes, over {proto.MAX_RANK_FRAME_BYTES} a frame")
                    self._settle()
                    continue
                unacked[event_id] = event
                writer.write(frame)
                await writer.drain()
        except (ConnectionError, OSError):
            return False
        finally:
            receiver.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await receiver

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
    variable dropped then, so no process the rank starts inherits either); None outside Vigil."""
    global _token
    if _token is None and (fd := os.environ.pop(proto.RANK_TOKEN_FD_ENV, None)):
        try:
            with os.fdopen(int(fd), "rb") as pipe:
                _token = pipe.read(4096).decode().strip() or None
        except (OSError, ValueError) as exc:
            log.error("vigil: no rank token on descriptor %s (%s): reporting is off", fd, exc)
    return _token
