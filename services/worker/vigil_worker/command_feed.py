"""A job attempt's commands for its ranks on this node (`CommandFeed`): read from the command stream where
the job stands, numbered in stream order, and delivered to every rank of that attempt here by its link
(`vigil_worker.relay`)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable

from vigil import events as ev
from vigil import protocol as proto
from vigil.errors import MalformedMessage, RetryableError
from vigil_common import subjects
from vigil_common.bus import Bus

log = logging.getLogger("vigil.worker")


class CommandFeed:
    """One attempt's commands for ranks, in stream order, numbered among that attempt's own from 1 (the
    same numbers on every node, wherever its read began); shared by its ranks here.

    The read begins where the job stands: after the job's newest command when that is an earlier
    attempt's (none of this attempt's can be stored before it), not at the job's first command. Only
    when this attempt's commands exist already (a rank that joins late, an agent restarted) is the
    job's whole history read."""

    def __init__(self, bus: Bus, job_id: str, attempt: int) -> None:
        self.bus, self.job_id, self.attempt = bus, job_id, attempt
        self.commands: list[proto.RankCommand] = []
        self.users = 0
        self.read_from = 1  # the command stream's sequence the read began at
        self._changed = asyncio.Condition()
        self._task: asyncio.Task[None] | None = None
        self._ready = asyncio.Event()

    async def start(self) -> None:
        self._task = asyncio.create_task(self._follow(), name=f"commands-{self.job_id}-{self.attempt}")
        await self._ready.wait()

    async def _start_at(self) -> int:
        try:
            newest = await self.bus.last_stored(subjects.COMMANDS.name, subjects.cmd(self.job_id))
            if newest is None:
                return 1
            if ev.decode(newest.data).attempt < self.attempt:
                return newest.seq + 1
        except (RetryableError, MalformedMessage) as exc:  # read it all: slower, never wrong
            log.warning("commands of %s: the newest is unreadable (%s); reading them all", self.job_id, exc)
        return 1

    async def _follow(self) -> None:
        try:
            self.read_from = await self._start_at()
            async with self.bus.watch(subjects.cmd(self.job_id), resume_at=[self.read_from]) as stream:
                self._ready.set()
                async for command in stream:
                    if proto.for_ranks(command) and command.attempt == self.attempt:
                        async with self._changed:
                            self.commands.append(command)
                            self._changed.notify_all()
        finally:
            self._ready.set()

    async def deliver(self, send: Callable[[bytes], None]) -> None:
        """Send every command so far, then each new one, as `Delivered` frames (until cancelled)."""
        sent = 0
        while True:
            async with self._changed:
                await self._changed.wait_for(lambda n=sent: len(self.commands) > n)
                new = self.commands[sent:]
            for command in new:
                sent += 1
                send(proto.encode_frame(proto.Delivered(seq=sent, command=command)))

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._task
