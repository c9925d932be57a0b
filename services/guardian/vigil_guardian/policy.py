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

Ids are derived from the incident's identity, so re-deciding the same fault (a redelivered event,
a restart) republishes the same ids, which JetStream de-duplicates.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from vigil.events import Command, HaltJob, IncidentAction, IncidentRaised, RestartJob, RollbackJob
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
