"""The policy: what the guardian does about a verdict, per the job's `GuardianSpec`.

- `alert`: an incident only.
- `halt`: the incident and `HaltJob`.
- `rollback`: for numeric faults (nan, spike, divergence) `HaltJob` then an in-place `RollbackJob`
  to the newest valid checkpoint with step <= the anomaly step (a checkpoint with step s holds the
  state after s updates, so it precedes the anomalous update), skipping the data window of the spike
  or NaN (a fault in the data comes back with it);
  for faults a rollback in place cannot cure (a hang, a sick GPU, a straggler, a device with too
  many silent data corruptions: `sdc`, whose device the relaunch leaves out) a `RestartJob`,
  relaunching the ranks: the incident's action is then "restart", not "rollback". After
  `max_rollbacks` rollbacks (restarts count) the next one becomes `fail`; with no checkpoint to go
  back to, it becomes `halt`.
- `fail`: the incident alone (action "fail"); the scheduler turns it into FAILED and cancels the ranks.

Every `Decision` the guardian makes is built here: a verdict's (`Policy.decide`), and the records of what
the ranks or the workers did themselves (a held step's replay, a device check, an out-of-memory halt, a
refused report).

Ids are derived from the incident's identity, so re-deciding the same fault (a redelivered event,
a restart) republishes the same ids, which JetStream de-duplicates.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from vigil.events import (
    Command,
    DeviceDiagnosed,
    DiagnoseDevice,
    HaltJob,
    IncidentAction,
    IncidentRaised,
    OutOfMemoryHalted,
    ReportRefused,
    RestartJob,
    RollbackJob,
    StepReplayed,
)
from vigil.spec import Action, GuardianSpec
from vigil_guardian.verdict import Verdict

IN_PLACE = frozenset({"nan", "spike", "divergence"})


@dataclass(frozen=True)
class Decision:
    """An incident and the commands it causes, in the order they are issued (`service.outgoing` says
    in which order they are published, and on which subjects)."""

    incident: IncidentRaised
    commands: tuple[Command, ...] = ()

    @property
    def action(self) -> IncidentAction:
        return self.incident.action


def incident_id(*key: object) -> str:
    """A stable id for an incident's identity (job, attempt, generation, kind, where)."""
    return "inc-" + hashlib.sha256(repr(key).encode()).hexdigest()[:28]


def rollback_target(checkpoints: Mapping[int, str], anomaly_step: int | None) -> tuple[int, str] | None:
    """The newest checkpoint (step, path) with step <= `anomaly_step` (any, when the step is unknown)."""
    steps = [s for s in checkpoints if anomaly_step is None or s <= anomaly_step]
    if not steps:
        return None
    best = max(steps)
    return best, checkpoints[best]


@dataclass(frozen=True)
class Policy:
    """What to do about a verdict under one job's `GuardianSpec` (a device that runs no job: the
    default spec, and its incidents are alerts)."""

    spec: GuardianSpec = field(default_factory=GuardianSpec)
    # The spec as changed at run time (`state.Retuned.evidence`): each incident says so.
    retuned: dict[str, Any] | None = None

    def action_for(self, kind: str) -> Action:
        return getattr(self.spec, kind) if kind in GuardianSpec.model_fields else "alert"

    def decide(
        self,
        verdict: Verdict,
        *,
        iid: str,
        job_id: str | None,
        attempt: int,
        checkpoints: Mapping[int, str],
        rollbacks: int,
        now: datetime,
        anomaly_step: int | None = None,
        data_position: int | None = None,
    ) -> Decision:
        """Turn a verdict into an incident and commands.

        Args:
            iid: the incident id (see `incident_id`).
            checkpoints: the job's valid checkpoints, step -> path.
            rollbacks: rollbacks already made for this job.
            anomaly_step: the step whose update is suspect (defaults to the verdict's step).
            data_position: the data step of the anomalous batch (the spike's skip window starts there).
        """
        spec = self.spec
        action = self.action_for(verdict.kind) if job_id else "alert"
        evidence: dict[str, Any] = dict(verdict.evidence)
        if self.retuned is not None:
            evidence["guardian_settings"] = self.retuned
        reason = verdict.message
        commands: list[Command] = []
        anomaly = verdict.step if anomaly_step is None else anomaly_step

        if action == "rollback" and rollbacks >= spec.max_rollbacks:
            action = "fail"
            reason = f"{verdict.message}; max_rollbacks ({spec.max_rollbacks}) reached"
            evidence["max_rollbacks"] = spec.max_rollbacks
        target = rollback_target(checkpoints, anomaly) if action == "rollback" else None
        if action == "rollback" and target is None:
            action = "halt"
            evidence["no_checkpoint"] = f"no valid checkpoint at or before step {anomaly}"

        common = {"job_id": job_id, "attempt": attempt, "occurred_at": now, "incident_id": iid}
        done: IncidentAction = action
        if action == "rollback" and target is not None:
            step, path = target
            in_place = verdict.kind in IN_PLACE
            skip = None
            if verdict.kind in ("spike", "nan") and spec.spike_skip_steps and data_position is not None:
                skip = (data_position, data_position + spec.spike_skip_steps)
            if in_place:
                commands.append(HaltJob(event_id=f"{iid}-halt", reason=reason, **common))
            fields = {"checkpoint": path, "step": step, "skip_data": skip, "reason": reason, **common}
            if in_place:
                commands.append(RollbackJob(event_id=f"{iid}-rollback", **fields))
            else:  # a device found to corrupt results is relaunched without (marked unhealthy first)
                node, device = verdict.node, verdict.device
                sick = [(node, device)] if verdict.kind == "sdc" and node and device is not None else []
                commands.append(RestartJob(event_id=f"{iid}-restart", unhealthy=sick, **fields))
                done = "restart"
            evidence.update(
                checkpoint=path,
                checkpoint_step=step,
                skip_data=list(skip) if skip else None,
                restart=not in_place,
                rollback=rollbacks + 1,
            )
        elif action == "halt":
            commands.append(HaltJob(event_id=f"{iid}-halt", reason=reason, **common))
        # action "fail": the incident alone. The scheduler, which owns job state, turns it into
        # FAILED and cancels the ranks itself; a CancelJob from here could race it to CANCELLED.
        incident = IncidentRaised(
            event_id=iid,
            job_id=job_id,
            attempt=attempt,
            occurred_at=now,
            kind=verdict.kind,
            action=done,
            step=verdict.step,
            rank=verdict.rank,
            node=verdict.node,
            device=verdict.device,
            message=reason,
            evidence=evidence,
        )
        return Decision(incident, tuple(commands))


# --- the decisions that record what the ranks or the workers did (no action of the guardian's own) ---


def _where(rank: int, placement: dict[int, tuple[str, int]]) -> str:
    node, device = placement.get(rank, ("?", -1))
    return f"rank {rank}, GPU {device} of node {node}"


def _number(x: float | None) -> str:
    return "non-finite" if x is None else f"{x:.4g}"


def checks_summary(event: DeviceDiagnosed) -> str:
    """What the worker's known-answer check of a device found, in a few words."""
    found = ", ".join(f"{name} off by {err:.3g}" for name, err in event.checks.items())
    return found or event.error or "no check ran"


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


def diagnosed_incident(event: DeviceDiagnosed, rank: int | None, verdict: Verdict | None = None) -> Decision:
    """An alert recording the worker's check: passed (the job's report is not upheld, no mark), could not
    run, or failed while the job was being recovered anyway (`verdict`; the scheduler marks the device
    from the worker's event itself). `device` stays unset: this incident marks nothing."""
    if verdict is not None:
        message = verdict.message
    elif event.passed:
        message = (
            f"GPU {event.device} of node {event.node} passed the worker's known-answer check "
            f"({checks_summary(event)}): the job's report of a transient fault is not upheld, the device "
            "stays"
        )
    else:
        message = (
            f"the check of GPU {event.device} of node {event.node} could not run: {checks_summary(event)}"
        )
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


def out_of_memory(event: OutOfMemoryHalted) -> Decision:
    """The ranks' own halt on an out-of-memory they could not cure, recorded as the `oom` incident (same
    id as their report, so a replay publishes it once)."""
    return Decision(
        IncidentRaised(
            event_id=event.event_id,
            job_id=event.job_id,
            attempt=event.attempt,
            kind="oom",
            action="halt",
            step=event.step,
            rank=event.rank,
            node=event.node if event.rank == 0 else None,
            message=event.message,
            evidence={
                "micro_batch": event.micro_batch,
                "grad_accum": event.grad_accum,
                "checkpoint_step": event.checkpoint_step,
            },
        )
    )


def report_refused(event: ReportRefused) -> Decision:
    """The agent refused what a rank of the job sent: an alert naming the field (the agent sends at most
    one per job and field every 30 s, with the count since the last)."""
    times = f" ({event.refused} refusals)" if event.refused > 1 else ""
    return Decision(
        IncidentRaised(
            event_id=incident_id(event.job_id, event.attempt, "report_refused", event.event_id),
            job_id=event.job_id,
            attempt=event.attempt,
            kind="report_refused",
            action="alert",
            rank=event.rank,
            node=event.node,
            message=f"rank {event.rank}'s {event.report} refused{times}: {event.field}: {event.reason}",
            evidence={"report": event.report, "field": event.field, "refused": event.refused},
        )
    )
