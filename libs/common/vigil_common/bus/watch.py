"""Watching: the stored messages of some subjects, read from their streams one by one (no consumer), for
the CLI, SSE and the ranks' commands."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any

from nats.aio.msg import Msg

from vigil.errors import MalformedMessage, RetryableError
from vigil.events import Message
from vigil_common import subjects
from vigil_common.bus.decoding import decode_stored
from vigil_common.bus.streams import Stored, Streams
from vigil_common.waiting import wait_any

log = logging.getLogger(__name__)

# A watcher reads its stream again this often when no wake-up came (one lost, or one that arrived
# before the message was stored); after a wake-up that found nothing yet, after these delays.
WATCH_RECHECK_S = 1.0
_STORE_WAIT_S = (0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2)


class EventStream:
    """Decoded messages from `Bus.watch`, in stream order per subject. Iterate with `async for`, or call
    `next(timeout)`; a cancelled wait (a timeout, say) loses nothing and the stream goes on.

    `position` says where the watch stands: per subject watched, the stream sequence of the next message
    not yet taken. A watch started at it (`Bus.watch(..., resume_at=position)`) yields exactly what this
    one has not yet (what the gateway's server-sent events carry as their id)."""

    def __init__(
        self,
        queue: asyncio.Queue[tuple[int, Stored]],
        decoder: Callable[[Stored], Message],
        start: Sequence[int],
    ) -> None:
        self._queue = queue
        self._decode = decoder
        self._position = list(start)

    @property
    def position(self) -> tuple[int, ...]:
        return tuple(self._position)

    def __aiter__(self) -> EventStream:
        return self

    async def __anext__(self) -> Message:
        while True:
            index, msg = await self._queue.get()
            self._position[index] = msg.seq + 1  # taken, decoded or not: a resume starts after it
            try:
                return self._decode(msg)
            except MalformedMessage as exc:
                log.warning("watch: skipping malformed message on %s: %s", msg.subject, exc)

    async def next(self, timeout: float | None = None) -> Message | None:
        """The next message, or None when none arrives within `timeout` seconds."""
        try:
            return await asyncio.wait_for(self.__anext__(), timeout)
        except TimeoutError:
            return None


class Watching(Streams):
    @contextlib.asynccontextmanager
    async def watch(
        self, *filter_subjects: str, from_start: bool = False, resume_at: Sequence[int] | None = None
    ) -> AsyncIterator[EventStream]:
        """The messages stored on `filter_subjects` from now on (all of them with `from_start`; those
        from an earlier watch's `EventStream.position` with `resume_at`), in stream order per subject.

        Usage: `async with bus.watch(subjects.ALL_INCIDENTS) as events: async for event in events: ...`

        No consumer: each subject's stream is read one message after another (`$JS.API.STREAM.MSG.GET`,
        the next stored on the subject after the last one read), woken by a core subscription to the
        subject. A JetStream consumer made without a name could carry any name in its request and
        replace another role's consumer, so the roles may not make one; and what is read is only what
        the stream stored, answered to this connection's own inbox: nothing pushed by anyone else
        reaches a watcher (ranks act only on commands from the command stream). Malformed messages
        are logged and skipped (nothing durable depends on a watcher).
        """
        if resume_at is not None and len(resume_at) != len(filter_subjects):
            raise ValueError(f"resume_at: {len(resume_at)} positions for {len(filter_subjects)} subjects")
        queue: asyncio.Queue[tuple[int, Stored]] = asyncio.Queue()
        subs: list[Any] = []
        followers: list[asyncio.Task[None]] = []
        starts: list[int] = []
        try:
            for index, subject in enumerate(filter_subjects):
                stream = subjects.stream_for(subject).name
                woken = asyncio.Event()

                async def wake(_msg: Msg, woken: asyncio.Event = woken) -> None:
                    woken.set()

                subs.append(await self.nc.subscribe(subject, cb=wake))  # before the start is read
                start = 1 if from_start else (await self.js.stream_info(stream)).state.last_seq + 1
                if resume_at is not None:  # never past the stream's end: a later one would skip what comes
                    start = max(1, min(resume_at[index], start))
                starts.append(start)
                followers.append(
                    asyncio.create_task(
                        self._follow(stream, subject, start, woken, functools.partial(_put, queue, index)),
                        name=f"watch {subject}",
                    )
                )
            yield EventStream(queue, functools.partial(decode_stored, filter_subjects), starts)
        finally:
            await _cancel(followers)
            for sub in subs:
                with contextlib.suppress(Exception):
                    await sub.unsubscribe()

    async def _follow(
        self, stream: str, subject: str, seq: int, woken: asyncio.Event, out: Callable[[Stored], None]
    ) -> None:
        """Put every message stored on `subject` from sequence `seq` on into `out`, for ever."""
        delays: list[float] = []  # after a wake-up that found nothing: the message may not be stored yet
        while True:
            woken.clear()
            before = seq
            seq = await self._read_stored(stream, subject, seq, out)
            if seq > before:
                delays = []
            if woken.is_set():
                continue
            if delays:
                await wait_any(woken, timeout_s=delays.pop(0))
                continue
            if await wait_any(woken, timeout_s=WATCH_RECHECK_S):
                delays = list(_STORE_WAIT_S)

    async def _read_stored(self, stream: str, subject: str, seq: int, out: Callable[[Stored], None]) -> int:
        """Read the messages stored on `subject` from sequence `seq` into `out`; the next sequence."""
        delay = 0.05
        while True:
            try:
                stored = await self.next_stored(stream, subject, seq)
            except RetryableError as exc:
                # a short outage is routine; one that lasts (or a read the role may not make) is not
                level = logging.WARNING if delay == 1.6 else logging.DEBUG
                log.log(level, "watch %s: %s, again in %.2fs", subject, exc, delay)
                await asyncio.sleep(delay)  # back-off while the server is away
                delay = min(delay * 2, 2.0)
                continue
            if stored is None or stored.seq < seq:
                return seq
            seq = stored.seq + 1
            out(stored)


def _put(queue: asyncio.Queue[tuple[int, Stored]], index: int, stored: Stored) -> None:
    queue.put_nowait((index, stored))


async def _cancel(tasks: Sequence[asyncio.Task[None]]) -> None:
    """Cancel `tasks` and wait until they end. A task is cancelled again while it runs on: Python 3.11's
    `asyncio.wait_for` (which nats-py's requests use) drops a cancellation that comes as its awaited
    result arrives, and a follower that lost one would read for ever."""
    pending = set(tasks)
    while pending:
        for task in pending:
            task.cancel()
        _, pending = await asyncio.wait(pending, timeout=0.5)
    for task in tasks:
        if not task.cancelled() and task.exception() is not None:
            log.debug("watch %s ended with %r", task.get_name(), task.exception())
