"""Where a rank's events go, and where its commands come from.

`NullSink` (the default) drops events and never has commands, so the rank program runs alone.
`BusSink` publishes from a background thread that runs its own asyncio loop and NATS connection:
`emit` hands the event over with `call_soon_threadsafe` and returns at once. The hand-over queue is
bounded; when it is full the event is dropped and counted (never blocking the training loop), and the
count is logged every time it grows by a power of two and at close.

The same thread watches `subjects.cmd(job)` from the stream's start (an ordered consumer), so every
rank sees the job's commands in the same order; the n-th command has sequence number n on every rank.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from pathlib import Path
from typing import Protocol

from vigil_common import subjects
from vigil_common.bus import Bus
from vigil_common.events import Message, StepCompleted
from vigil_worker.trainer.exits import write_last_step

log = logging.getLogger("vigil.rank")


class Sink(Protocol):
    dropped: int

    def emit(self, subject: str, event: Message) -> None: ...

    @property
    def latest_seq(self) -> int: ...

    def command(self, seq: int, timeout_s: float) -> Message: ...

    def arrival(self, seq: int) -> float | None: ...

    def close(self, timeout_s: float = 10.0) -> None: ...


class NullSink:
    """No backend: events vanish, no commands ever arrive."""

    dropped = 0

    def emit(self, subject: str, event: Message) -> None:
        pass

    @property
    def latest_seq(self) -> int:
        return 0

    def command(self, seq: int, timeout_s: float) -> Message:
        raise TimeoutError("no command source")

    def arrival(self, seq: int) -> float | None:
        return None

    def close(self, timeout_s: float = 10.0) -> None:
        pass


class BusSink:
    """Publishes events and receives commands on a background thread with its own event loop."""

    def __init__(
        self, url: str, job_id: str, name: str, *, queue_size: int = 10_000, tls_ca: Path | None = None
    ) -> None:
        self.url, self.job_id, self.name, self.tls_ca = url, job_id, name, tls_ca
        self.dropped = 0
        self.failed = 0
        self.last_step: int | None = None  # the last step published, noted for the worker at close
        self._queue_size = queue_size
        self._commands: list[Message] = []
        self._arrivals: list[float] = []  # time.monotonic() when each command reached this rank
        self._cond = threading.Condition()
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._queue: asyncio.Queue[tuple[str, Message] | None] | None = None
        self._thread = threading.Thread(target=self._run, name="vigil-bus", daemon=True)

    def start(self, timeout_s: float = 30.0) -> BusSink:
        """Connect and subscribe to commands before returning (so no command of the job is missed)."""
        self._thread.start()
        if not self._ready.wait(timeout_s):
            raise TimeoutError(f"bus sink: no connection to {self.url} within {timeout_s}s")
        if self._error:
            raise self._error
        return self

    # --- called from the training thread ---------------------------------------------------------------

    def emit(self, subject: str, event: Message) -> None:
        """Queue an event for publishing; never blocks (a full queue drops and counts the event)."""
        if self._loop is not None and not self._loop.is_closed():
            self._loop.call_soon_threadsafe(self._put, (subject, event))

    @property
    def latest_seq(self) -> int:
        with self._cond:
            return len(self._commands)

    def command(self, seq: int, timeout_s: float) -> Message:
        """The command with sequence number `seq` (1-based), waiting up to `timeout_s` for it to arrive."""
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

    def close(self, timeout_s: float = 10.0) -> None:
        """Publish what is queued (up to `timeout_s`), then disconnect."""
        if self._loop is not None and self._thread.is_alive():
            self._loop.call_soon_threadsafe(self._put, None)
            self._thread.join(timeout_s)
        if self.last_step is not None:
            with contextlib.suppress(OSError):
                write_last_step(self.last_step)  # the worker's RankExited.last_step
        if self.dropped or self.failed:
            log.warning(
                "bus sink: %d events dropped (queue full), %d failed to publish", self.dropped, self.failed
            )

    # --- the background thread -------------------------------------------------------------------------

    def _put(self, item: tuple[str, Message] | None) -> None:
        assert self._queue is not None
        if item is None:  # close: the publisher stops once the queue is empty
            self._closing = True
            with contextlib.suppress(asyncio.QueueFull):  # full: the publisher is busy and sees _closing
                self._queue.put_nowait(None)
            return
        try:
            self._queue.put_nowait(item)
        except asyncio.QueueFull:
            self.dropped += 1
            if self.dropped & (self.dropped - 1) == 0:  # 1, 2, 4, 8, ...
                log.warning("bus sink: queue full, %d events dropped so far", self.dropped)

    def _run(self) -> None:
        try:
            asyncio.run(self._main())
        except BaseException as exc:  # reported to start() or logged; the training thread goes on
            if not self._ready.is_set():
                self._error = exc
                self._ready.set()
            else:
                log.exception("bus sink: background thread failed")

    async def _main(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._queue = asyncio.Queue(self._queue_size)
        self._closing = False
        bus = await Bus.connect(self.url, name=self.name, tls_ca=self.tls_ca)
        try:
            async with bus.watch(subjects.cmd(self.job_id), from_start=True) as commands:
                watcher = asyncio.create_task(self._watch(commands))
                self._ready.set()
                await self._publish_all(bus)
                watcher.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await watcher
        finally:
            await bus.close()

    async def _watch(self, commands: object) -> None:
        async for event in commands:  # type: ignore[attr-defined]
            with self._cond:
                self._commands.append(event)
                self._arrivals.append(time.monotonic())
                self._cond.notify_all()

    async def _publish_all(self, bus: Bus) -> None:
        assert self._queue is not None
        while True:
            item = await self._queue.get()
            if item is None:
                return
            subject, event = item
            try:
                await bus.publish(subject, event)
            except Exception as exc:
                self.failed += 1
                log.warning("bus sink: publishing %s to %s failed: %s", event.type, subject, exc)
            else:
                if isinstance(event, StepCompleted):
                    self.last_step = event.step
            if self._closing and self._queue.empty():
                return
