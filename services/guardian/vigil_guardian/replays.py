"""Steps the ranks held and replayed (`StepReplayed`): the incident that records each, and the strikes
that tell a sick device from bad data.

The ranks decide a held step themselves, at its boundary, by the job's own rules; the guardian keeps the
record and the count. A replay that came out clean was a transient fault on the rank that produced the
bad value: its device (node, GPU) gets a strike. `guardian.sdc_strikes` strikes within
`guardian.sdc_window` steps make an `sdc` verdict: the policy relaunches the job without the device
(`RestartJob.unhealthy`), which the scheduler marks unhealthy with the evidence. Pure: no I/O.
"""

from __future__ import annotations

from vigil_common.events import IncidentRaised, StepReplayed
from vigil_guardian.policy import Decision, incident_id
from vigil_guardian.state import Control
from vigil_guardian.verdict import Verdict


def _where(rank: int, placement: dict[int, tuple[str, int]]) -> str:
    node, device = placement.get(rank, ("?", -1))
    return f"rank {rank}, GPU {device} of node {node}"


def _number(x: float | None) -> str:
    return "non-finite" if x is None else f"{x:.4g}"


def replay_incident(event: StepReplayed, placement: dict[int, tuple[str, int]]) -> Decision:
    """The incident for a held step: what was bad, where, and what the replay showed."""
    culprit = event.culprits[0] if event.culprits else None
    where = ", ".join(_where(r, placement) for r in event.culprits) or "no rank's loss (the gradients)"
    values = "; ".join(f"rank {v.rank}: {_number(v.first)} then {_number(v.replay)}" for v in event.values)
    if event.outcome == "transient":
        action, verdict = "replay", f"transient on {where}: replay clean"
    else:
        start, end = event.skip_data or (event.data_position, event.data_position + 1)
        action, verdict = "skip", f"reproduced on {where}: data {start:,}..{end - 1:,} skipped"
    node, device = placement.get(culprit, (None, None)) if culprit is not None else (None, None)
    return Decision(
        IncidentRaised(
            event_id=incident_id(event.job_id, event.attempt, "replay", event.event_id),
            job_id=event.job_id,
            attempt=event.attempt,
            kind=event.kind,
            action=action,
            step=event.step,
            rank=culprit,
            node=node,
            device=device,
            message=f"step {event.step} held ({event.kind}): {verdict} ({values})",
            evidence={
                "outcome": event.outcome,
                "culprits": event.culprits,
                "values": [v.model_dump(mode="json") for v in event.values],
                "data_position": event.data_position,
                "skip_data": list(event.skip_data) if event.skip_data else None,
                "held_s": event.held_s,
                "devices": [list(placement[r]) for r in event.culprits if r in placement],
                **event.evidence,
            },
        )
    )


def strike(c: Control, where: tuple[str, int], rank: int, event: StepReplayed) -> Verdict | None:
    """A strike on the device `where` (node, GPU) of `rank` for the transient fault of `event`; the `sdc`
    verdict once the device has `sdc_strikes` within `sdc_window` steps (its strikes then start over)."""
    node, device = where
    key = f"{node}:{device}"
    steps = [s for s in c.strikes.get(key, []) if s > event.step - c.spec.sdc_window and s != event.step]
    steps.append(event.step)
    c.strikes[key] = steps
    if len(steps) < c.spec.sdc_strikes:
        return None
    del c.strikes[key]
    values = {v.rank: v for v in event.values}
    v = values.get(rank)
    return Verdict(
        kind="sdc",
        step=event.step,
        rank=rank,
        node=node,
        device=device,
        message=f"silent data corruption on GPU {device} of node {node}: {len(steps)} transient faults "
        f"(steps {', '.join(map(str, sorted(steps)))}) that a replay did not reproduce",
        evidence={
            "strikes": sorted(steps),
            "sdc_strikes": c.spec.sdc_strikes,
            "sdc_window": c.spec.sdc_window,
            "last": {"step": event.step, "first": v.first, "replay": v.replay} if v else None,
        },
    )
