"""Fault injection from the job spec, for tests and demos.

A fault fires once per job, like a transient hardware fault (`sdc`, `crash`, `hang`, `oom`, ...), so
that a replay or a rollback past it succeeds; `repeat: true` makes it fire every time its step is
reached. "Once per job" survives a rollback and a restart of the ranks: a fired fault leaves a marker
file under the job's checkpoint directory (`<root>/<job>/.vigil/faults/<index>.fired`, created with
O_EXCL, so no two processes race).

`nan` and `spike` are faults in the data: they fire whenever their step reads their data position (the
one the step first read, noted in the marker, or the spec's `data_position`), so a replay of the step
reproduces them and skipping that data cures them.
"""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path
from typing import TYPE_CHECKING

from vigil.exits import write_exit_file
from vigil.spec import (
    CrashFault,
    Fault,
    HangFault,
    NanFault,
    OomFault,
    SdcFault,
    SlowRankFault,
    SpikeFault,
)

if TYPE_CHECKING:
    from vigil.run import Run

log = logging.getLogger("vigil.rank")


class FaultInjector:
    def __init__(self, faults: list[Fault], rank: int, marker_dir: Path) -> None:
        self.rank = rank
        self.marker_dir = marker_dir
        self._mine = [(i, f) for i, f in enumerate(faults) if f.rank == rank]
        self._slow_from: dict[int, float] = {}  # index -> delay, for slow_rank faults that fired

    def _fire(self, index: int, fault: Fault) -> bool:
        """True if the fault fires now: always for `repeat`, else only the first time in the job."""
        if fault.repeat:
            return True
        self.marker_dir.mkdir(parents=True, exist_ok=True)
        try:
            fd = os.open(self.marker_dir / f"{index}.fired", os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            return False
        with os.fdopen(fd, "w") as fh:
            fh.write(f"{fault.kind} step={fault.step} rank={self.rank} at={time.time():.3f}\n")
        return True

    def loss_factor(self, step: int, position: int) -> float:
        """What this rank's loss is multiplied by at `step` reading data `position` before backward: NaN,
        a spike factor, or 1."""
        factor = 1.0
        for i, f in self._mine:
            if f.step != step:
                continue
            if isinstance(f, NanFault | SpikeFault) and self._in_data(i, f, position):
                factor *= float("nan") if isinstance(f, NanFault) else f.factor
            elif isinstance(f, SdcFault) and self._fire(i, f):
                factor *= float("nan") if f.factor is None else f.factor
        return factor

    def _in_data(self, index: int, fault: NanFault | SpikeFault, position: int) -> bool:
        """Is the data fault in `position`? Its spec's position, else the one its step first read."""
        if fault.repeat:
            return True
        if fault.data_position is not None:
            return position == fault.data_position
        marker = self.marker_dir / f"{index}.fired"
        if self._fire(index, fault):
            with marker.open("a") as fh:
                fh.write(f"position={position}\n")
            return True
        for line in marker.read_text().splitlines():
            if line.startswith("position="):
                return int(line.removeprefix("position=")) == position
        return False

    def delay_s(self, step: int) -> float:
        """Extra seconds this rank sleeps at `step` (slow_rank: from its step on, once it has fired)."""
        for i, f in self._mine:
            if (
                isinstance(f, SlowRankFault)
                and f.step == step
                and i not in self._slow_from
                and self._fire(i, f)
            ):
                self._slow_from[i] = f.delay_s
        return sum(self._slow_from.values())

    def clear_transient(self) -> None:
        """A rollback ends a slow phase (a repeat fault re-arms when its step comes again)."""
        self._slow_from.clear()

    def crash_code(self, step: int) -> int | None:
        for i, f in self._mine:
            if isinstance(f, CrashFault) and f.step == step and self._fire(i, f):
                return f.exit_code
        return None

    def out_of_memory(self, step: int) -> bool:
        """True when this rank's step `step` runs out of memory here (the loop raises the error)."""
        return any(isinstance(f, OomFault) and f.step == step and self._fire(i, f) for i, f in self._mine)

    def hangs(self, step: int) -> bool:
        return any(isinstance(f, HangFault) and f.step == step and self._fire(i, f) for i, f in self._mine)

    def act(self, step: int, run: Run) -> None:
        """Crash, hang or slow down here when the job spec injects it at `step`."""
        if (code := self.crash_code(step)) is not None:
            log.error("injected crash at step %d: exiting with code %d", step, code)
            write_exit_file(code)
            run.close()  # what was reported so far reaches the bus
            logging.shutdown()
            os._exit(code)
        if self.hangs(step):
            log.error("injected hang at step %d: this rank stops stepping", step)
            while True:
                time.sleep(3600)
        if delay := self.delay_s(step):
            time.sleep(delay)
