"""A job's preemption on a worker (`job_preemption.Commands`): the notice goes to that job's attempt's
ranks only, before the command is acknowledged, once under redelivery; ranks still running after the grace
period are ended; every other command is the agent's."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

from vigil.events import CancelJob, PreemptJob
from vigil.preemption import SIGNAL
from vigil_worker.job_preemption import Commands


@dataclass
class Rank:
    job_id: str
    attempt: int
    rank: int
    killed: bool = False
    reported: bool = False
    parked_at: float | None = None


@dataclass
class Table:
    ranks: list[Rank]
    notified: list[tuple[str, int, int, int]] = field(default_factory=list)

    def running(self, job_id: str | None = None) -> list[Rank]:
        return [r for r in self.ranks if not r.reported and job_id in (None, r.job_id)]

    def notify(self, r: Rank, sig: int) -> None:
        self.notified.append((r.job_id, r.attempt, r.rank, sig))


class FakeWorker:
    def __init__(self, ranks: list[Rank], grace_s: float) -> None:
        self.table = Table(ranks)
        self.settings = SimpleNamespace(preemption_grace_s=grace_s)
        self.commands: list[Any] = []
        self.ended: list[Rank] = []

    async def on_command(self, command: Any, delivery: Any) -> None:
        self.commands.append(command)

    async def monitor_once(self) -> None:
        pass

    async def end_ranks(self, ranks: list[Rank]) -> None:
        for r in ranks:
            r.killed = r.reported = True
        self.ended += ranks


def preempt(job: str, attempt: int) -> PreemptJob:
    return PreemptJob(job_id=job, attempt=attempt, kind="preempt", reason="preempted by j-b", by_job="j-b")


async def test_only_that_attempts_ranks_get_the_notice_once_and_late_ones_are_ended() -> None:
    mine = [Rank("j-a", 2, 0), Rank("j-a", 2, 1)]
    others = [Rank("j-a", 1, 0), Rank("j-c", 2, 0), Rank("j-a", 2, 2, parked_at=1.0)]
    worker = FakeWorker(mine + others, grace_s=0.2)
    commands = Commands(worker)  # type: ignore[arg-type]
    command = preempt("j-a", 2)
    await commands.on_command(command, None)  # type: ignore[arg-type]
    assert worker.table.notified == [("j-a", 2, 0, SIGNAL), ("j-a", 2, 1, SIGNAL)]  # before the ack
    await commands.on_command(command, None)  # type: ignore[arg-type]  # a redelivery
    assert len(worker.table.notified) == 2
    mine[0].reported = True  # rank 0 checkpointed and exited in time; rank 1 did not
    await asyncio.wait_for(commands._stops[command.event_id], 5)
    assert worker.ended == [mine[1]]
    assert not any(r.killed for r in others)


async def test_every_other_command_is_the_agents() -> None:
    worker = FakeWorker([Rank("j-a", 1, 0)], grace_s=1.0)
    cancel = CancelJob(job_id="j-a", attempt=1, reason="user")
    await Commands(worker).on_command(cancel, None)  # type: ignore[arg-type]
    assert worker.commands == [cancel] and worker.table.notified == []
