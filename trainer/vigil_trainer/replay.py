"""A held step, replayed once in place to tell a sick device from bad data.

The ranks judged the step bad at its boundary (`step_judge`) and hold it: its update is dropped by the
SDK's one skip (`vigil.integrations.deepspeed.skip_step`: the optimizer's step gated, the LR schedule
not moved, the weights checked unchanged). They run it again, on the same ranks, from the same
parameters and the same data (the data is a pure function of the position):

- the replay is clean: a transient fault (a flipped bit, a sick GPU). Its result goes on as the step's;
  the guardian gives the device of the rank that produced the bad value a strike;
- the replay reproduces it: the data (or the model state) is the cause. The data window is skipped and
  the step runs on the next data, from the same parameters, with no checkpoint loaded;
- that step is bad again: the parameters are. It is not held: it goes on as a bad step, and the
  guardian rolls back to the last good checkpoint as it always has.

Rank 0 reports the outcome (`StepReplayed`); the guardian records it as an incident.
"""

from __future__ import annotations

import logging
import math
import time
from typing import Any

from vigil import events as ev
from vigil.boundary import Boundary
from vigil.identity import first_position
from vigil.integrations.deepspeed import skip_step
from vigil_trainer.context import RankContext, TrainState
from vigil_trainer.micro import MicroSteps, execute
from vigil_trainer.step_judge import Bad

log = logging.getLogger("vigil.rank")


def settle(
    ctx: RankContext, st: TrainState, step: int, bad: Bad, held: Boundary
) -> tuple[MicroSteps, Boundary]:
    """Hold the step the boundary `held` judged `bad`, replay it, and return the execution that goes on
    (the replay, or the step on the next data after a skip)."""
    t0, pos = time.perf_counter(), st.data_position
    skip_step(ctx.engine)
    log.warning("step %d: held (%s on ranks %s); replaying it", step, bad.kind, bad.culprits or "unknown")
    m, agreed = execute(ctx, st, step)
    if agreed.oom_rank is not None:
        return m, agreed  # the caller halts
    if ctx.judge.judge(agreed.losses, agreed.all_finite) is None:
        log.warning("step %d: the replay is clean: a transient fault", step)
        report(ctx, step, bad, "transient", held, agreed, pos, None, time.perf_counter() - t0)
        return m, agreed
    skip_step(ctx.engine)
    window = (pos, pos + max(1, ctx.spec.guardian.spike_skip_steps))
    ctx.run.skip_windows.append(window)
    st.data_position = first_position(pos, ctx.run.skip_windows)
    log.warning("step %d: the replay reproduces it: data %d..%d skipped", step, window[0], window[1] - 1)
    report(ctx, step, bad, "reproduced", held, agreed, pos, window, time.perf_counter() - t0)
    return execute(ctx, st, step)


def report(
    ctx: RankContext,
    step: int,
    bad: Bad,
    outcome: ev.ReplayOutcome,
    first: Boundary,
    replay: Boundary,
    pos: int,
    skip: tuple[int, int] | None,
    held_s: float,
) -> None:
    who = ctx.run.identity
    if who.rank != 0:
        return
    culprits = bad.culprits[: ev.MAX_CULPRITS]  # a report names at most this many (the first ones)
    ctx.run.emit(
        ev.StepReplayed(
            job_id=who.job_id,
            attempt=who.attempt,
            step=step,
            node=who.node,
            kind=bad.kind,
            outcome=outcome,
            culprits=culprits,
            values=[
                ev.RankValue(rank=r, first=_finite(first.losses[r]), replay=_finite(replay.losses[r]))
                for r in culprits
            ],
            data_position=pos,
            skip_data=skip,
            held_s=held_s,
            evidence=bounded(bad.evidence, len(bad.culprits)),
        )
    )


def bounded(evidence: dict[str, Any], culprits: int) -> dict[str, Any]:
    """The spike rule's evidence within `ev.MAX_EVIDENCE_BYTES`: the first ranks' numbers that fit, and
    how many ranks were culprits (`culprits_total`) when not all are there."""
    if ev.evidence_size(evidence) <= ev.MAX_EVIDENCE_BYTES:
        return evidence
    out: dict[str, Any] = {k: v for k, v in evidence.items() if k != "ranks"}
    out["culprits_total"] = culprits
    kept: dict[str, Any] = {}
    for rank, numbers in dict(evidence.get("ranks", {})).items():
        if ev.evidence_size({**out, "ranks": {**kept, rank: numbers}}) > ev.MAX_EVIDENCE_BYTES:
            break
        kept[rank] = numbers
    return {**out, "ranks": kept} if ev.evidence_size({**out, "ranks": kept}) <= ev.MAX_EVIDENCE_BYTES else {}


def _finite(x: float) -> float | None:
    return x if math.isfinite(x) else None
