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

Pure: no I/O. The incidents of a replay and of a device check are built with every other decision, in
`vigil_guardian.policy` (`replay_incident`, `diagnosed_incident`).
"""

from __future__ import annotations

from vigil.events import DeviceDiagnosed, DiagnoseDevice, StepReplayed
from vigil_guardian.policy import checks_summary, incident_id
from vigil_guardian.state import Control
from vigil_guardian.verdict import Verdict

DIAGNOSES_MAX = 8  # a job's own replay reports ask the workers for at most this many device checks


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


def diagnosis_verdict(event: DeviceDiagnosed, rank: int | None, step: int | None) -> Verdict:
    """The `sdc` verdict of a device that failed the worker's known-answer check."""
    return Verdict(
        kind="sdc",
        step=step,
        rank=rank,
        node=event.node,
        device=event.device,
        message=f"silent data corruption on GPU {event.device} of node {event.node}: it failed the "
        f"worker's known-answer check ({checks_summary(event)}) after the job reported a transient fault",
        evidence={"diagnostic": event.model_dump(mode="json", include={"passed", "checks", "error"})},
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
