"""The ranks' verdict on a step at its boundary, before the optimizer step: is it one to hold?

Every rank has every rank's loss from the boundary all-reduce, and applies the job's rules to them, the
same numbers in the same order, so every rank reaches the same verdict without another collective:

- `nan`: some rank's loss (or, without ZeRO in fp32, the gradients) was not finite;
- `spike`: some rank's loss is a spike by the spec's rule (`vigil.spike_rule`, the guardian's).

A step is held only where the spec's action for its kind is `rollback` and `guardian.replay` is on:
with `alert`, `halt` or `fail` the step goes on as before and the guardian acts on the reported step.
Pure: no I/O, no torch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Literal

from vigil.spec import GuardianSpec
from vigil.spike_rule import LossWindows


@dataclass(frozen=True)
class Bad:
    """A step the ranks hold: what was wrong, on which ranks, and the numbers."""

    kind: Literal["nan", "spike"]
    culprits: list[int]  # the ranks whose loss was bad (empty: only the gradients were not finite)
    evidence: dict[str, Any] = field(default_factory=dict)


class StepJudge:
    """The spike rule's windows over every rank's losses, kept identically on every rank."""

    def __init__(self, spec: GuardianSpec) -> None:
        self.spec = spec
        self.windows = LossWindows(spec.spike_window, spec.spike_warmup)

    def holds(self, kind: str) -> bool:
        return self.spec.replay and getattr(self.spec, kind) == "rollback"

    def judge(self, losses: tuple[float, ...], all_finite: bool) -> Bad | None:
        """The step's verdict when it is to be held; None when it goes on (fine, or not ours to hold)."""
        if not losses:
            return None
        if not all_finite:
            bad = Bad("nan", [r for r, x in enumerate(losses) if not math.isfinite(x)])
        else:
            scores = {r: self.windows.judge(r, x, self.spec.spike_zscore) for r, x in enumerate(losses)}
            culprits = [r for r, s in scores.items() if s is not None]
            if not culprits:
                return None
            evidence = {
                str(r): {"loss": losses[r], "median": s.median, "mad": s.mad, "zscore": s.zscore}
                for r, s in scores.items()
                if s is not None
            }
            bad = Bad("spike", culprits, {"ranks": evidence, "threshold": self.spec.spike_zscore})
        return bad if self.holds(bad.kind) else None

    def add(self, step: int, losses: tuple[float, ...]) -> None:
        """A step applied: its finite losses join the windows."""
        for rank, loss in enumerate(losses):
            self.windows.add(rank, step, loss)

    def rewind(self, to_step: int) -> None:
        """A rollback to `to_step`: the steps from there on are forgotten."""
        self.windows.rewind(to_step)
