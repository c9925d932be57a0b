"""A run's in-memory snapshots (`vigil.snapshot` holds the copies, the files and the peer exchange): what
to copy and how to load it back, when one is due, and the collective choices around them.

Every `every` steps `Run.after_step` copies the registered state to host memory (the rest runs in the
background); a disk checkpoint's step is kept in the process too (`pin`), so that an in-place rollback
to it loads from memory when every rank holds it. `every` "auto": every step for the first few, then the
interval each rank measured (a snapshot's cost against a step), the largest agreed by all ranks.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal

from vigil import collective
from vigil import snapshot as snap
from vigil.snapshot_choice import auto_interval
from vigil.snapshot_files import snapshot_folder_from_env

log = logging.getLogger("vigil")

AUTO_PROBE = 3  # "auto" takes this many snapshots in a process (every step), then agrees on its interval


class RunSnapshots:
    """One rank's snapshot schedule. Made by `open`, on every rank together."""

    def __init__(self, snapshots: snap.Snapshots) -> None:
        self.snapshots = snapshots
        self._state: Callable[[], Any] | None = None  # None: none taken (a run that only restores)
        self._load: Callable[[Any], Any] | None = None
        self.every = 1  # take one every this many steps
        self.auto = False  # memory_every auto: `every` is measured, then agreed
        self.tuned = False  # auto: measured and agreed
        self._last: int | None = None  # the step of the newest snapshot taken

    def register(
        self, state: Callable[[], Any], load: Callable[[Any], Any] | None, every: int | Literal["auto"]
    ) -> None:
        """Take `state()` every `every` steps from now on; `load(state)` loads one back in place."""
        self._state, self._load = state, load
        self.auto = every == "auto"
        self.every = 1 if every == "auto" else int(every)
        if self.snapshots.rank == 0:
            folder = self.snapshots.folder
            where = (
                f"{folder.root}, peer copy on rank {self.snapshots.partner}"
                if folder
                else "this process only"
            )
            log.info("vigil: in-memory snapshots every %s step(s) (%s)", every, where)

    @property
    def taking(self) -> bool:
        return self._state is not None

    @classmethod
    def open(cls, *, job_id: str, rank: int, world: int) -> RunSnapshots:
        """Every rank together: the folder on this node (`VIGIL_SNAPSHOT_DIR`) where every rank has one
        (a rank without: none of them writes, the exchange pairs ranks), and the peer exchange's own gloo
        group, apart from training's."""
        folder = snapshot_folder_from_env(job_id)
        group = None
        if collective.distributed():
            import torch.distributed as dist

            if collective.everywhere(folder is not None):
                group = dist.new_group(backend="gloo")  # the background thread's own
            else:
                folder = None
        return cls(
            snap.Snapshots(
                folder,
                job_id=job_id,
                rank=rank,
                world=world,
                local_world=int(os.environ.get("LOCAL_WORLD_SIZE", "1")),
                group=group,
            )
        )

    @property
    def cost(self) -> snap.SnapshotCost:
        return self.snapshots.cost

    def wait(self) -> None:
        """Wait for the last snapshot's background work (its files and its peer copy)."""
        self.snapshots.wait()

    def at_boundary(
        self, step: int, *, step_s: float, data_position: int, skip_windows: list[tuple[int, int]]
    ) -> None:
        """Every rank, before running `step`: wait for the last snapshot's background work (it is whole,
        own and peer copy, one step after it was taken), and take one of `step` when it is due."""
        self.snapshots.wait()
        if self._state is None:
            return
        if self.auto and not self.tuned and self.cost.taken >= AUTO_PROBE:
            self._agree_interval(step_s)  # every rank took as many: they agree at the same boundary
        if step % self.every == 0:
            self.take(step, data_position=data_position, skip_windows=skip_windows)

    def take(
        self, step: int, *, data_position: int, skip_windows: list[tuple[int, int]], pin: bool = False
    ) -> None:
        """Every rank: a snapshot of `step` now (`pin`: a disk checkpoint's step, kept in the process for
        a rollback to it); a step already taken is not taken again."""
        if self._state is None or (step == self._last and not pin):
            return
        self.snapshots.take(
            step, self._state(), data_position=data_position, skip_windows=skip_windows, pin=pin
        )
        self._last = step

    def _agree_interval(self, step_s: float) -> None:
        n = collective.highest(auto_interval(self.cost.each_s, step_s))
        self.every, self.tuned = n, True
        log.info(
            "vigil: in-memory snapshots (auto): every %d step(s) (one costs %.1f ms against a %.1f ms step)",
            n,
            1000 * self.cost.each_s,
            1000 * step_s,
        )

    def held_everywhere(self, step: int) -> snap.Held | None:
        """Every rank (collective): this process's copy of `step` where every rank holds one and the run
        can load it in place (a `load` registered); None: load the disk checkpoint."""
        held = self.snapshots.in_process(step) if self._load is not None else None
        return held if collective.everywhere(held is not None) else None

    def load(self, held: snap.Held) -> None:
        """Load a held copy in place (a copy of it: the optimizer keeps what it loads)."""
        assert self._load is not None
        self._load(snap.to_host(held.state))

    def restore(
        self, resume_from: Path, checkpoint_root: Path, *, skip: bool, safe_globals: list[Any] | None
    ) -> snap.Restored | None:
        """Every rank, on a relaunch: the newest snapshot every rank has whole, no older than
        `resume_from` (`Snapshots.resume` says which may be taken); None: none. Where the job changed its
        size since the snapshot (elastic), its state is every former rank's, in rank order (`resized_from`:
        the former size)."""
        got = self.snapshots.resume(resume_from, checkpoint_root, skip=skip)
        if got is None:
            return None
        m = got.manifest
        self._last = m.step
        resized = got.world != self.snapshots.world
        states = [snap.deserialize(data, safe_globals) for _, data in got.shards]
        return snap.Restored(
            step=m.step,
            state=states if resized else states[0],
            data_position=m.data_position,
            skip_windows=[(int(a), int(b)) for a, b in m.skip_windows],
            resized_from=got.world if resized else None,
        )

    def drop_after(self, step: int) -> None:
        self.snapshots.drop_after(step)
        if self._last is not None and self._last > step:
            self._last = None

    def finish(self) -> None:
        """Before the process ends: the last snapshot's background work ends first."""
        self.snapshots.finish()

    def remove_all(self) -> None:
        self.snapshots.remove_all()
