"""What the loop tells an observer about its timing, with a no-op default.

Production ranks run with `NullObserver`; a benchmark passes its own to `rank.main(argv, observer=...)`
to learn each step's wall time, each in-place rollback's timing and the snapshots' cost, without switches
in the loop. Hooks run on the training thread, so an observer keeps them cheap.
"""

from __future__ import annotations

from typing import Protocol

from vigil.recovery import Rollback
from vigil.snapshot import SnapshotCost


class Observer(Protocol):
    def on_step_end(self, step: int, seconds: float) -> None:
        """Called right after `step`'s optimizer step; `seconds` is its wall time from the step's start."""
        ...

    def on_rollback(self, timing: Rollback) -> None:
        """Called once an in-place rollback has loaded its checkpoint (`Run.last_rollback`)."""
        ...

    def on_snapshots(self, every: int, steps: int, cost: SnapshotCost) -> None:
        """Called once training ends: what in-memory snapshots cost over its `steps` steps."""
        ...


class NullObserver:
    """Observes nothing: the production default."""

    def on_step_end(self, step: int, seconds: float) -> None:
        pass

    def on_rollback(self, timing: Rollback) -> None:
        pass

    def on_snapshots(self, every: int, steps: int, cost: SnapshotCost) -> None:
        pass
