"""Steps the ranks held and replayed (`StepReplayed`): the incident that records each, and the strikes
that tell a sick device from bad data.

The ranks decide a held step themselves, at its boundary, by the job's own rules; the guardian keeps the
record and the count. A replay that came out clean was a transient fault on the rank that produced the
bad value. Whether that counts against the device depends on who says so:

- the built-in trainer (the job's launch has no entrypoint: the worker's own program, `Control.vouched`):
  its device (node, GPU) gets a strike. `guardian.sdc_strikes` strikes within `guardian.sdc_window`
  steps make an `sdc` verdict: the policy relaunches the job without the device (`RestartJob.unhealthy`),
  which the scheduler marks unhealthy for VIGIL_DEVICE_MARK_TTL_S, at most VIGIL_DEVICE_MARKS_PER_JOB
  devices per job;
- a user program (its own `StepReplayed`, which it may forge at will): no strike. The report is evidence,
  and the guardian asks the device's worker to run its known-answer check (`DiagnoseDevice`, once per
  device and attempt, at most `DIAGNOSES_MAX` per job). Only the worker's `DeviceDiagnosed` with
  `passed` False makes the `sdc` verdict; a pass is an alert that the report was not upheld.

Pure: no I/O.
"""

from __future__ import annotations

from vigil.events import DeviceDiagnosed, DiagnoseDevice, IncidentRaised, StepReplayed
from vigil_guardian.policy import Decision, incident_id
from vigil_guardian.state import Control
from vigil_guardian.verdict import Verdict


def _where(rank: int, placement: dict[int, tuple[str, int]]) -> str:
    node, device = placement.get(rank, ("?", -1))
    return f"rank {rank}, GPU {device} of node {node}"


def _number(x: float | None) -> str:
    return "non-finite" if x is None else f"{x:.4g}"


DIAGNOSES_MAX = 8  # a job's own replay reports ask the workers for at most this many device checks


def replay_incident(
    event: StepReplayed, placement: dict[int, tuple[str, int]], asks: list[DiagnoseDevice] | None = None
) -> Decision:
    """The incident for a held step: what was bad, where, and what the replay showed; with `asks`, the
    report is a user program's, and the checks it asked for go out with it."""
    culprit = event.culprits[0] if event.culprits else None
    where = ", ".join(_where(r, placement) for r in event.culprits) or "no rank's loss (the gradients)"
    values = "; ".join(f"rank {v.rank}: {_number(v.first)} then {_number(v.replay)}" for v in event.values)
    if event.outcome == "transient":
        action, verdict = "replay", f"transient on {where}: replay clean"
    else:
        start, end = event.skip_data or (event.data_position, event.data_position + 1)
        action, verdict = "skip", f"reproduced on {where}: data {start:,}..{end - 1:,} skipped"
    node, device = placement.get(culprit, (None, None)) if culprit is not None else (None, None)
    vouched = asks is None
    if not vouched:
        checks = ", ".join(f"GPU {a.device} of node {a.node}" for a in asks or []) or "none (asked already)"
        verdict += f"; the job's own report, not a strike: device check asked: {checks}"
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
                "vouched": vouched,
                "diagnose": [[a.node, a.device] for a in asks or []],
            },
        ),
        tuple(asks or ()),
    )


def diagnose(c: Control, rank: int, event: StepReplayed) -> DiagnoseDevice | None:
    """The check of `rank`'s device that a user program's transient replay asks for; None when that
    device was asked about in this attempt already, or the job has asked `DIAGNOSES_MAX` times."""
    if (where := c.placement.get(rank)) is None:
        return None
    node, device = where
    key = f"{node}:{device}"
    if key in c.diagnoses and c.diagnoses[key][0] == event.attempt:
        return None
    if key not in c.diagnoses and len(c.diagnoses) >= DIAGNOSES_MAX:
        return None
    c.diagnoses[key] = (event.attempt, event.step)
    return DiagnoseDevice(
        event_id=incident_id(event.job_id, event.attempt, "diagnose", key),
        job_id=event.job_id,
        attempt=event.attempt,
        node=node,
        device=device,
        reason=f"rank {rank} of the job reported a transient fault at step {event.step} (its own replay)",
    )


def _checks(event: DeviceDiagnosed) -> str:
    found = ", ".join(f"{name} off by {err:.3g}" for name, err in event.checks.items())
    return found or event.error or "no check ran"


def diagnosis_verdict(event: DeviceDiagnosed, rank: int | None, step: int | None) -> Verdict:
    """The `sdc` verdict of a device that failed the worker's known-answer check."""
    return Verdict(
        kind="sdc",
        step=step,
        rank=rank,
        node=event.node,
        device=event.device,
        message=f"silent data corruption on GPU {event.device} of node {event.node}: it failed the "
        f"worker's known-answer check ({_checks(event)}) after the job reported a transient fault",
        evidence={"diagnostic": event.model_dump(mode="json", include={"passed", "checks", "error"})},
    )


def diagnosed_incident(event: DeviceDiagnosed, rank: int | None, verdict: Verdict | None = None) -> Decision:
    """An alert recording the worker's check: passed (the job's report is not upheld, no mark), could not
    run, or failed while the job was being recovered anyway (`verdict`; the scheduler marks the device
    from the worker's event itself). `device` stays unset: this incident marks nothing."""
    if verdict is not None:
        message = verdict.message
    elif event.passed:
        message = (
            f"GPU {event.device} of node {event.node} passed the worker's known-answer check "
            f"({_checks(event)}): the job's report of a transient fault is not upheld, the device stays"
        )
    else:
        message = f"the check of GPU {event.device} of node {event.node} could not run: {_checks(event)}"
    return Decision(
        IncidentRaised(
            event_id=incident_id(event.job_id, event.attempt, "diagnosed", event.event_id),
            job_id=event.job_id,
            attempt=event.attempt,
            kind="sdc",
            action="alert",
            rank=rank,
            node=event.node,
            message=message,
            evidence={
                "device": event.device,
                **event.model_dump(mode="json", include={"passed", "checks", "error", "duration_s"}),
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
