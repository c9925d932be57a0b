"""Warm ranks: built-in trainer processes a worker keeps started, imports done, for its next ranks.

A relaunch (a crashed rank, a rollback that restarts the job) then takes a warm process instead of
starting Python, torch and DeepSpeed again (about 3 s on a CPU). How many: `VIGIL_WARM_RANKS` per node
(unset: one per device, enough for one job's ranks here; 0: none). On a GPU node each waits for one
device (its CUDA_VISIBLE_DEVICES is set before torch is imported); on a CPU node any serves any slot.

A warm process runs no job's code before its launch (`vigil_trainer.standby`), and only the built-in trainer
is run warm: a job's own program is started as it always is, its imports being its own. One taken is
replaced a little later, on idle cycles only (SCHED_IDLE). On a CPU node even idle cycles are the ranks'
(a rank waiting in a collective wakes to caches the imports took: the bench's steps ran 5-10 % slower
for the seconds an import ran), so there a replacement waits until no rank runs on the node, unless the
pool is short of one relaunch of the ranks that run.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass, field

from vigil.handover import READY
from vigil_common.settings import Settings
from vigil_worker import cgroups
from vigil_worker.launch import RankLaunch, handed_launch, standby_env
from vigil_worker.tenancy import JobUser

log = logging.getLogger("vigil.worker")

STANDBY_MODULE = "vigil_trainer.standby"
REPLACE_AFTER_S = 5.0  # a taken warm rank is replaced this long after (the launched ranks start first)


@dataclass
class Standby:
    """One warm process: `device` the GPU it waits for (None on a CPU node)."""

    proc: subprocess.Popen[bytes]
    device: int | None
    ready: asyncio.Event = field(default_factory=asyncio.Event)

    def hand(self, rank: RankLaunch, user: JobUser | None, group: cgroups.JobCgroup | None) -> None:
        """Make it `rank`: its launch, one JSON line on its stdin (see `vigil.handover.Launch`)."""
        rank.log_path.parent.mkdir(parents=True, exist_ok=True)
        procs = group.procs_files() if group is not None else []
        line = handed_launch(rank, user.uid if user else None, user.gid if user else None, procs)
        assert self.proc.stdin is not None
        self.proc.stdin.write(line)
        self.proc.stdin.close()  # its launch said: nothing more comes this way
        if self.proc.stdout is not None:
            self.proc.stdout.close()


class WarmRanks:
    """This node's warm ranks: `take(device)` one that is ready, or None."""

    def __init__(
        self, settings: Settings, kind: str, devices: list[int], running: Callable[[], int] = lambda: 0
    ) -> None:
        self.settings, self.kind, self.running = settings, kind, running  # `running`: ranks on this node
        self.count = len(devices) if settings.warm_ranks is None else settings.warm_ranks
        # which device each keeps waiting for: one per device in turn (a CPU node's serve any slot)
        self.slots: list[int | None] = [
            devices[i % len(devices)] if kind == "gpu" and devices else None for i in range(self.count)
        ]
        self.log_dir = settings.log_dir / "warm"
        self.standbys: list[Standby] = []
        self.taken = 0  # launches served warm
        self.owed: list[int | None] = []  # the devices of taken ones not yet replaced
        self._tasks: set[asyncio.Task[None]] = set()
        self._closed = False

    async def start(self) -> WarmRanks:
        for device in self.slots:
            self._spawn(device)
        return self

    def take(self, device: int) -> Standby | None:
        """A ready warm rank for `device` (any, on a CPU node), taken out of the pool, or None."""
        key = device if self.kind == "gpu" else None
        for standby in self.standbys:
            if standby.device == key and standby.ready.is_set() and standby.proc.poll() is None:
                self.standbys.remove(standby)
                self.taken += 1
                self.owed.append(key)
                self._refill_later()
                return standby
        return None

    def ranks_ended(self) -> None:
        """Ranks ended here: look again a little later (a relaunch may take their place at once)."""
        if self.owed:
            self._refill_later()

    def refill(self) -> None:
        """Replace the taken ones that may be now (see the module's docstring)."""
        while self.owed and self._may_spawn():
            self._spawn(self.owed.pop(0))

    def _may_spawn(self) -> bool:
        if self.kind != "cpu":
            return True  # the ranks are on their GPUs: the imports take cores they leave free
        running = self.running()
        return running == 0 or len(self.standbys) < running

    async def close(self) -> None:
        self._closed = True
        for task in list(self._tasks):
            task.cancel()
        for standby in self.standbys:
            with contextlib.suppress(OSError, ValueError):
                if standby.proc.stdin is not None:
                    standby.proc.stdin.close()  # let go: it ends
        for standby in self.standbys:
            try:
                await asyncio.to_thread(standby.proc.wait, 5)
            except subprocess.TimeoutExpired:
                standby.proc.kill()
                await asyncio.to_thread(standby.proc.wait)
        self.standbys.clear()

    # --- keeping the pool ----------------------------------------------------------------------------------

    def _spawn(self, device: int | None) -> None:
        if self._closed:
            return
        self.log_dir.mkdir(parents=True, exist_ok=True)
        with (self.log_dir / f"standby-{len(self.standbys)}.log").open("ab") as err:
            proc = subprocess.Popen(
                [sys.executable, "-m", STANDBY_MODULE],
                env=standby_env(self.settings, self.kind, device),
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=err,
                start_new_session=True,
                close_fds=True,
            )  # no preexec_fn: a vfork, not a fork of the worker's whole process; it lowers itself
        standby = Standby(proc, device)
        self.standbys.append(standby)
        self._track(self._warmed(standby))

    async def _warmed(self, standby: Standby) -> None:
        assert standby.proc.stdout is not None
        line = await asyncio.to_thread(standby.proc.stdout.readline)
        if line == READY:
            standby.ready.set()
            ready = sum(s.ready.is_set() for s in self.standbys)
            if ready == self.count:
                log.info("%d warm rank(s) ready", ready)
            return
        code = await asyncio.to_thread(standby.proc.wait)
        log.warning("a warm rank ended before it was ready (exit %s); see %s", code, self.log_dir)
        with contextlib.suppress(ValueError):
            self.standbys.remove(standby)

    def _refill_later(self) -> None:
        async def replace() -> None:
            await asyncio.sleep(REPLACE_AFTER_S)  # a delay on purpose: the launched ranks' start goes first
            self.refill()

        self._track(replace())

    def _track(self, work: object) -> None:
        task = asyncio.ensure_future(work)  # type: ignore[arg-type]
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
