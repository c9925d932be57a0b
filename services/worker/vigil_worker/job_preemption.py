"""The spot path for one job (`PreemptJob`): the scheduler preempts it for a job of higher priority, or
stops it at its time limit. This node's ranks of that job's attempt, and only those, get the preemption
notice the whole node gets from its cloud (`Worker.preempt`): they finish the step, write the emergency
checkpoint (or snapshot) within VIGIL_PREEMPTION_GRACE_S and exit `preempted`; the ones still running after
the grace are ended. Unlike a node's notice the node keeps offering its devices: once the ranks are out, the
next heartbeat says they are free, for the job that preempted them.

`Commands.on_command` is the worker's command consumer: `PreemptJob` here, every other command the
agent's (`Worker.on_command`). The notice goes out before the command is acknowledged; the wait for the grace
period runs in the background (the consumer goes on to a cancel that follows), once per command under
redelivery.
"""

from __future__ import annotations

import asyncio
import logging
import time

from vigil.events import Message, PreemptJob
from vigil.preemption import SIGNAL as PREEMPTION_SIGNAL
from vigil_common.bus import Delivery
from vigil_worker.agent import MONITOR_INTERVAL_S, Worker
from vigil_worker.procs import RankRecord

log = logging.getLogger("vigil.worker")

REMEMBERED = 1000  # stop commands remembered against redelivery


class Commands:
    def __init__(self, worker: Worker) -> None:
        self.worker = worker
        self._stops: dict[str, asyncio.Task[None]] = {}  # PreemptJob event id -> its stop

    async def on_command(self, command: Message, delivery: Delivery) -> None:
        if not isinstance(command, PreemptJob):
            await self.worker.on_command(command, delivery)
            return
        if command.event_id in self._stops or not (ranks := self._ranks(command)):
            return  # a redelivery, or no rank of that attempt here
        grace = self.worker.settings.preemption_grace_s
        log.warning("%s attempt %d: %s; %d rank(s) here checkpoint within %.0fs", command.job_id,
                    command.attempt, command.reason, len(ranks), grace)  # fmt: skip
        for r in ranks:  # before the command is acknowledged: the notice is the effect
            self.worker.table.notify(r, PREEMPTION_SIGNAL)
        self._stops[command.event_id] = asyncio.create_task(
            self.end_late(command, ranks, grace), name=f"stop-{command.job_id}-{command.attempt}"
        )
        while len(self._stops) > REMEMBERED:
            self._stops.pop(next(iter(self._stops)))

    def _ranks(self, command: PreemptJob) -> list[RankRecord]:
        """The attempt's ranks here that run (neither ended by us already nor parked)."""
        return [
            r
            for r in self.worker.table.running(str(command.job_id))
            if r.attempt == command.attempt and not r.killed and r.parked_at is None
        ]

    async def end_late(self, command: PreemptJob, ranks: list[RankRecord], grace: float) -> None:
        """End those of the notified `ranks` still running when the grace period is over. Returns once every
        one has exited and been reported."""
        deadline = time.monotonic() + grace
        while any(not r.reported for r in ranks) and time.monotonic() < deadline:
            await self.worker.monitor_once()  # as `Worker.preempt`: report each exit as it happens
            if any(not r.reported for r in ranks):
                await asyncio.sleep(MONITOR_INTERVAL_S)  # polling the processes, not synchronisation
        if late := [r for r in ranks if not r.reported]:
            log.error("%s: %d rank(s) did not exit within the grace period: ending them", command.job_id,
                      len(late))  # fmt: skip
            await self.worker.end_ranks(late)
