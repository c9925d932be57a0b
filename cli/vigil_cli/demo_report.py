"""What `vigil demo` saw, summarised: pure functions over the events of one job, and its plot."""

from __future__ import annotations

import math
import statistics
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from vigil import events as ev
from vigil.spec import JobSpec

# Which incident kinds catch which injected fault.
CATCHES: dict[str, tuple[str, ...]] = {
    "nan": ("nan",),
    "spike": ("spike",),
    "slow_rank": ("imbalance", "straggler"),
    "hang": ("hang",),
    "crash": ("rank_exit",),
    "sdc": ("nan", "spike"),
}
# Incident actions that are the ranks' own recovery of a held step (no rollback needed).
HELD = ("replay", "skip")


@dataclass
class Recording:
    """Every event of one job, in arrival order."""

    job_id: str
    steps: list[ev.StepCompleted] = field(default_factory=list)
    incidents: list[ev.IncidentRaised] = field(default_factory=list)
    commands: list[ev.Message] = field(default_factory=list)
    rollbacks: list[ev.RollbackCompleted] = field(default_factory=list)
    replays: list[ev.StepReplayed] = field(default_factory=list)
    states: list[ev.JobStateChanged] = field(default_factory=list)

    def add(self, event: ev.Message) -> None:
        if event.job_id != self.job_id:
            return
        match event:
            case ev.StepCompleted():
                self.steps.append(event)
            case ev.IncidentRaised():
                self.incidents.append(event)
            case ev.HaltJob() | ev.RollbackJob() | ev.ResumeJob() | ev.CancelJob():
                self.commands.append(event)
            case ev.RollbackCompleted():
                self.rollbacks.append(event)
            case ev.StepReplayed():
                self.replays.append(event)
            case ev.JobStateChanged():
                self.states.append(event)

    @property
    def final_state(self) -> str | None:
        return self.states[-1].to_state if self.states else None


def _finite(x: float | None) -> float | None:
    return x if x is not None and math.isfinite(x) else None


def summarise(rec: Recording, spec: JobSpec, *, wall_s: float, paths: dict[str, str]) -> dict[str, Any]:
    """The demo's summary: steps, losses, incidents with their fault-to-command time, rollbacks, time lost."""
    rank0 = [s for s in rec.steps if s.rank == 0]
    step_times = [s.step_time_s for s in rank0 if s.step_time_s > 0]
    median_step = statistics.median(step_times) if step_times else 0.0

    incidents = []
    for inc in rec.incidents:
        fault_at = next(
            (
                s.occurred_at
                for s in rec.steps
                if s.step == inc.step and (inc.rank is None or s.rank == inc.rank)
            ),
            None,
        )
        command = next(
            (c for c in rec.commands if c.occurred_at >= inc.occurred_at and not isinstance(c, ev.ResumeJob)),
            None,
        )
        latency = (command.occurred_at - fault_at).total_seconds() if command and fault_at else None
        incidents.append(
            {
                "kind": inc.kind,
                "action": inc.action,
                "step": inc.step,
                "rank": inc.rank,
                "node": inc.node,
                "fault_to_command_s": round(latency, 4) if latency is not None else None,
                "command": command.type if command else None,
                "message": inc.message,
            }
        )

    rollbacks = [
        {
            "from_step": r.from_step,
            "to_step": r.to_step,
            "checkpoint": r.checkpoint,
            "data_skipped": list(r.skip_data) if r.skip_data else None,
            "duration_s": round(r.duration_s, 3),
        }
        for r in rec.rollbacks
    ]
    detection = sum(
        i["fault_to_command_s"] or 0.0 for i in incidents if i["action"] in ("rollback", "restart", "halt")
    )
    redo = sum((r.from_step - r.to_step) * median_step + r.duration_s for r in rec.rollbacks)
    held = sum(r.held_s for r in rec.replays)
    held_s = {(r.step, r.kind): r.held_s for r in rec.replays}
    held_steps = [
        {
            "step": i["step"],
            "kind": i["kind"],
            "action": i["action"],
            "rank": i["rank"],
            "held_s": round(held_s.get((i["step"], i["kind"]), 0.0), 3),
            "attribution": i["message"].split(": ", 1)[-1],
        }
        for i in incidents
        if i["action"] in HELD
    ]

    caught = []
    for fault in spec.faults:
        kinds = CATCHES[fault.kind]
        found = any(i["kind"] in kinds and (i["step"] is None or i["step"] >= fault.step) for i in incidents)
        rolled = (
            fault.kind not in ("nan", "spike", "sdc")
            or any(r.from_step >= fault.step for r in rec.rollbacks)
            or any(i["action"] in HELD and i["step"] == fault.step for i in incidents)
        )
        caught.append(
            {"fault": fault.kind, "step": fault.step, "rank": fault.rank, "caught": found and rolled}
        )

    losses = [_finite(s.loss) for s in rank0]
    finite = [x for x in losses if x is not None]
    mfus = sorted(s.mfu for s in rec.steps if s.mfu is not None)
    state = rec.final_state
    return {
        "job_id": rec.job_id,
        "state": state,
        "ok": state == "SUCCEEDED" and all(c["caught"] for c in caught),
        "steps_run": len(rank0),
        "last_step": rank0[-1].step if rank0 else None,
        "first_loss": finite[0] if finite else None,
        "final_loss": finite[-1] if finite else None,
        "faults": caught,
        "incidents": incidents,
        "held_steps": held_steps,
        "rollbacks": rollbacks,
        "time_lost_s": round(detection + redo + held, 3),
        "median_step_s": round(median_step, 4),
        "median_mfu": round(mfus[len(mfus) // 2], 4) if mfus else None,  # per rank, against its peak
        "flops_per_token": rank0[-1].flops_per_token if rank0 else None,
        "wall_s": round(wall_s, 2),
        **paths,
    }


def plot(rec: Recording, path: Path) -> Path:
    """Loss per rank in execution order, incidents and rollbacks marked; written as a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    per_rank: dict[int, list[tuple[int, float, int]]] = defaultdict(list)
    for s in rec.steps:
        per_rank[s.rank].append((len(per_rank[s.rank]), s.loss, s.step))
    fig, ax = plt.subplots(figsize=(10, 5), dpi=110)
    for rank, points in sorted(per_rank.items()):
        xs = [i for i, loss, _ in points if math.isfinite(loss)]
        ys = [loss for _, loss, _ in points if math.isfinite(loss)]
        ax.plot(xs, ys, label=f"rank {rank}", linewidth=1.2)
        bad = [i for i, loss, _ in points if not math.isfinite(loss)]
        if bad:
            top = max(ys) * 1.5 if ys else 1.0
            ax.scatter(
                bad, [top] * len(bad), marker="x", color="red", zorder=3, label=f"rank {rank} non-finite"
            )
    rank0 = per_rank.get(0, [])
    for inc in rec.incidents:
        points = per_rank.get(inc.rank if inc.rank is not None else 0, rank0)
        x = next((i for i, _, step in points if step == inc.step), None)
        if x is not None:
            ax.axvline(x, color="red", linestyle="--", alpha=0.7)
            ax.annotate(
                f"{inc.kind} @ {inc.step}",
                (x, ax.get_ylim()[1]),
                rotation=90,
                va="top",
                fontsize=8,
                color="red",
            )
    for rb in rec.rollbacks:
        x = next((i for i, _, step in rank0 if step == rb.from_step), None)
        if x is not None:
            ax.axvline(x + 0.5, color="green", linestyle=":", alpha=0.8)
            ax.annotate(
                f"rollback -> {rb.to_step}",
                (x + 0.5, ax.get_ylim()[0]),
                rotation=90,
                va="bottom",
                fontsize=8,
                color="green",
            )
    ax.set_yscale("log")
    ax.set_xlabel("steps executed (re-run steps after a rollback included)")
    ax.set_ylabel("loss")
    ax.set_title(f"vigil demo: {rec.job_id}")
    ax.legend(loc="upper right", fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)
    return path
