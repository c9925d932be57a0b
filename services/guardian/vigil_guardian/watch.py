"""One job as the guardian sees it: its policy, attempts, timelines, checkpoints and detector windows.

`JobWatch` is pure: events and the current time go in, `Decision`s come out; the service around
it publishes them. Its control state (policy, attempt, checkpoints, rollbacks, recovery) is small
and saved after every change (`snapshot`/`restore`); its windows (losses, step times, the
imbalance run) are rebuilt after a restart by replaying the job's step events quietly.

Timelines. After an in-place rollback the ranks re-run steps they already ran. Events of the
abandoned timeline can still arrive late; they were created before the rollback completed, so
events of this attempt created before `gen_started_at` are dropped. While a rollback or halt is
in progress (`recovering`), events created after the decision are held back and judged once the
rollback completes (or the halt ends), so one fault gives one incident.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import asdict, dataclass
from datetime import datetime
from typing import Any, Literal

from vigil_common.events import (
    CheckpointSaved,
    JobStateChanged,
    LaunchJob,
    Message,
    RankExited,
    RanksHalted,
    RankStarted,
    RollbackCompleted,
    RollbackJob,
    StepCompleted,
)
from vigil_common.jobstates import TERMINAL_STATES, JobState
from vigil_common.spec import GuardianSpec
from vigil_guardian.exits import rank_exit
from vigil_guardian.hang import hang
from vigil_guardian.policy import Decision, decide, incident_id
from vigil_guardian.verdict import Verdict
from vigil_guardian.windows import Windows

EPISODE_GAP = 5  # anomalies of one kind within this many steps of the last one are one episode
BUFFER_MAX = 20_000  # events held back during a recovery
SEEN_MAX = 50_000  # event ids remembered, so a redelivered event is judged once


@dataclass
class Recovering:
    """A decision that stopped the job's timeline, until the ranks report back."""

    kind: Literal["rollback", "halt", "restart", "fail"]
    since: float  # epoch seconds of the decision
    to_step: int | None = None
    checkpoint: str | None = None


@dataclass
class Episode:
    start: int
    last: int


class JobWatch:
    """The guardian's view of one job."""

    def __init__(self, job_id: str) -> None:
        self.job_id = job_id
        self.spec = GuardianSpec()
        self.world_size: int | None = None
        self.final_step: int | None = None  # the job's last step (train.steps - 1), from its launch
        self.placement: dict[int, tuple[str, int]] = {}  # rank -> (node, device)
        self.attempt = 0
        self.attempt_started_at = 0.0
        self.generation = 0
        self.gen_started_at = -math.inf
        self.state: JobState | None = None
        self.checkpoints: dict[int, str] = {}
        self.rollbacks = 0
        self.recovering: Recovering | None = None
        self.started: set[int] = set()
        self.exited: set[int] = set()
        self.running_since: float | None = None
        self.last_rollback_completed: str | None = None
        self._seen: dict[str, None] = {}
        self._reset_windows()

    # --- state ------------------------------------------------------------------------------------

    def _reset_windows(self) -> None:
        self.windows = Windows(self.spec)
        self.episodes: dict[str, Episode] = {}
        self.buffer: list[StepCompleted] = []
        self.hang_raised = False

    @property
    def terminal(self) -> bool:
        return self.state in TERMINAL_STATES

    @property
    def nodes(self) -> dict[int, str]:
        return {r: p[0] for r, p in self.placement.items()}

    def running(self) -> bool:
        """Is the job meant to be making steps now?"""
        if self.state == JobState.RUNNING:
            return True
        if self.state is not None and self.state != JobState.SCHEDULED:
            return False
        # No word from the scheduler (or only SCHEDULED): inferred from the ranks.
        return self.world_size is not None and (
            len(self.started) >= self.world_size or bool(self.windows.progress)
        )

    def _new_attempt(self, attempt: int, at: float) -> None:
        self.attempt = attempt
        self.attempt_started_at = at
        self.generation = 0
        self.gen_started_at = -math.inf
        self.recovering = None
        self.started.clear()
        self.exited.clear()
        self.running_since = None
        if self.state not in TERMINAL_STATES:
            self.state = None
        self._reset_windows()

    def _current(self, event: Message) -> bool:
        """Is the event about the current attempt (starting a newer one if it is newer)?"""
        if event.attempt < self.attempt:
            return False
        if event.attempt > self.attempt:
            self._new_attempt(event.attempt, event.occurred_at.timestamp())
        return True

    # --- events -----------------------------------------------------------------------------------

    def on_launch(self, event: LaunchJob) -> None:
        if not self._current(event):
            return
        spec_changed = event.spec.guardian != self.spec
        self.spec = event.spec.guardian
        self.placement = {p.rank: (p.node, p.device) for p in event.placement}
        self.world_size = len(event.placement)
        self.final_step = event.spec.train.steps - 1
        if not self.attempt_started_at:
            self.attempt_started_at = event.occurred_at.timestamp()
        if spec_changed:
            self.windows.resize(self.spec)

    def on_step(self, event: StepCompleted, now: datetime, *, quiet: bool = False) -> list[Decision]:
        """Judge one rank's step. `quiet`: rebuild windows only (a replay of events already judged)."""
        if self.terminal or not self._current(event) or event.event_id in self._seen:
            return []
        self._seen[event.event_id] = None
        if len(self._seen) > SEEN_MAX:
            del self._seen[next(iter(self._seen))]
        t = event.occurred_at.timestamp()
        if t < self.gen_started_at:
            return []  # the abandoned timeline of a rollback
        rec = self.recovering
        if rec is not None:
            if rec.kind in ("restart", "fail"):
                return []  # this attempt is being ended
            if t >= rec.since:
                if len(self.buffer) < BUFFER_MAX:
                    self.buffer.append(event)
                return []
            quiet = True  # in flight when the decision was made: part of the fault already handled
        return self._judge(event, now, quiet)

    def _judge(self, event: StepCompleted, now: datetime, quiet: bool) -> list[Decision]:
        if self.running_since is None:
            self.running_since = event.occurred_at.timestamp()
        self.hang_raised = False
        verdicts = self.windows.observe(event, self.world_size, self.nodes)
        out = []
        for v in verdicts:
            if self.recovering is not None:
                break  # the first verdict already stopped the job
            if d := self._episode(v, now, quiet, data_position=event.data_position):
                out.append(d)
        return out

    def _episode(
        self,
        v: Verdict,
        now: datetime,
        quiet: bool,
        *,
        data_position: int | None = None,
        anomaly_step: int | None = None,
    ) -> Decision | None:
        """One incident per episode of a kind; a decision unless `quiet`."""
        ep = self.episodes.get(v.kind)
        step = v.step if v.step is not None else -1
        if ep is not None and ep.start - EPISODE_GAP <= step <= ep.last + EPISODE_GAP:
            ep.last = max(ep.last, step)
            return None
        self.episodes[v.kind] = Episode(step, step)
        if quiet:
            return None
        return self.decide(v, now, data_position=data_position, anomaly_step=anomaly_step, key=step)

    def decide(
        self,
        v: Verdict,
        now: datetime,
        *,
        data_position: int | None = None,
        anomaly_step: int | None = None,
        key: object = None,
        iid: str | None = None,
    ) -> Decision:
        """A decision for a verdict under this job's policy, applying its effect on the job."""
        iid = iid or incident_id(
            self.job_id, self.attempt, self.generation, v.kind, key, v.rank, v.node, v.device
        )
        before = {"rollbacks_before": self.rollbacks, "recovering_before": self.recovering}
        d = decide(
            v,
            iid=iid,
            job_id=self.job_id,
            attempt=self.attempt,
            spec=self.spec,
            checkpoints=self.checkpoints,
            rollbacks=self.rollbacks,
            now=now,
            anomaly_step=anomaly_step,
            data_position=data_position,
        )
        ts = now.timestamp()
        if d.action == "rollback":
            self.rollbacks += 1
            target = next(c for c in d.commands if isinstance(c, RollbackJob))
            kind = "restart" if target.restart else "rollback"
            self.recovering = Recovering(kind, ts, target.step, target.checkpoint)
        elif d.action in ("halt", "fail"):
            self.recovering = Recovering(d.action, ts)  # type: ignore[arg-type]
        redo = {"verdict": v, "data_position": data_position, "anomaly_step": anomaly_step, **before}
        return dataclasses.replace(d, effects={**d.effects, "redo": redo})

    def refresh(self, d: Decision) -> Decision:
        """The same decision made again with what the job knows now (checkpoints or policy that
        arrived on the status and launch subjects a moment after the step that caused it)."""
        redo = d.effects.get("redo")
        if redo is None or self.terminal:
            return d
        self.rollbacks, self.recovering = redo["rollbacks_before"], redo["recovering_before"]
        return self.decide(
            redo["verdict"],
            d.incident.occurred_at,
            data_position=redo["data_position"],
            anomaly_step=redo["anomaly_step"],
            iid=d.incident.event_id,
        )

    def on_status(self, event: Message, now: datetime) -> list[Decision]:
        if isinstance(event, CheckpointSaved):
            self.checkpoints[event.step] = event.path  # a saved checkpoint outlives its attempt
            return []
        if self.terminal:
            return []
        if isinstance(event, JobStateChanged):
            return self._on_state(event, now)
        if not self._current(event):
            return []
        t = event.occurred_at.timestamp()
        if isinstance(event, RankStarted):
            self.started.add(event.rank)
            if self.world_size and len(self.started) >= self.world_size and self.running_since is None:
                self.running_since = t
        elif isinstance(event, RankExited):
            self.exited.add(event.rank)
            self.windows.progress.pop(event.rank, None)
            if v := rank_exit(event):
                iid = incident_id(self.job_id, self.attempt, "rank_exit", event.rank)
                return [
                    decide(
                        v,
                        iid=iid,
                        job_id=self.job_id,
                        attempt=self.attempt,
                        spec=self.spec,
                        checkpoints=self.checkpoints,
                        rollbacks=self.rollbacks,
                        now=now,
                    )
                ]
        elif isinstance(event, RanksHalted):
            self.state = JobState.HALTED
        elif isinstance(event, RollbackCompleted):
            return self._on_rollback_completed(event, now)
        return []

    def _on_state(self, event: JobStateChanged, now: datetime) -> list[Decision]:
        if event.attempt and event.attempt < self.attempt:
            return []
        if event.attempt > self.attempt:
            self._new_attempt(event.attempt, event.occurred_at.timestamp())
        was = self.state
        self.state = event.to_state
        if event.to_state != JobState.RUNNING or was == JobState.RUNNING:
            return []
        t = event.occurred_at.timestamp()
        self.running_since = t
        progress = self.windows.progress
        self.windows.progress = {r: (t, p[1]) for r, p in progress.items()}  # the wait starts again
        self.hang_raised = False
        if self.recovering is not None and self.recovering.kind == "halt":
            return self._release(-math.inf, now)  # resumed after a halt: the timeline goes on
        return []

    def _on_rollback_completed(self, event: RollbackCompleted, now: datetime) -> list[Decision]:
        if event.event_id == self.last_rollback_completed:
            return []
        self.last_rollback_completed = event.event_id
        t = event.occurred_at.timestamp()
        rec = self.recovering
        if rec is not None and rec.checkpoint and rec.checkpoint != event.checkpoint:
            # The ranks refused the checkpoint we named (corrupt) and used an earlier one.
            self.checkpoints = {s: p for s, p in self.checkpoints.items() if p != rec.checkpoint}
        self.generation += 1
        self.gen_started_at = t
        to = event.to_step
        self.checkpoints = {s: p for s, p in self.checkpoints.items() if s <= to}  # later ones: abandoned
        self.windows.rewind(to, t, [r for r in range(self.world_size or 0) if r not in self.exited])
        self.episodes.clear()
        self.hang_raised = False
        self.state = JobState.RUNNING
        self.running_since = t
        return self._release(t, now)

    def _release(self, created_after: float, now: datetime) -> list[Decision]:
        """End a recovery and judge the events held back during it."""
        held, self.buffer, self.recovering = self.buffer, [], None
        out: list[Decision] = []
        for e in held:
            if e.occurred_at.timestamp() >= created_after and e.attempt == self.attempt:
                if self.recovering is None:
                    out += self._judge(e, now, quiet=False)
                elif len(self.buffer) < BUFFER_MAX:
                    self.buffer.append(e)
        return out

    # --- hang -------------------------------------------------------------------------------------

    def check_hang(self, now: datetime) -> list[Decision]:
        """A hang decision if some rank has been silent too long (called on a timer)."""
        if self.terminal or self.hang_raised or self.world_size is None:
            return []
        ts = now.timestamp()
        ranks = [r for r in range(self.world_size) if r not in self.exited]
        if not ranks:
            return []
        rec = self.recovering
        median = self.windows.median_step_s()
        if rec is not None:
            if rec.kind != "rollback":
                return []
            # A rollback that does not complete within hang_timeout_s is a hang too (loading a
            # checkpoint takes what it takes, whatever the step time: no step-time multiple here).
            progress = {r: (rec.since, rec.to_step - 1 if rec.to_step else None) for r in ranks}
            median = None
        elif self.running():
            start = self.running_since or self.attempt_started_at or ts
            progress = {r: self.windows.progress.get(r, (start, None)) for r in ranks}
            if self.final_step is not None and all(
                last is not None and last >= self.final_step for _, last in progress.values()
            ):
                # Every rank has made the job's last step: what is left (final saves, leaving the
                # process group, exiting) is not a step, so no step-time multiple applies, only the
                # plain timeout (on a busy machine the exit alone can take several step times).
                median = None
        elif self.state in (None, JobState.SCHEDULED) and self.attempt_started_at:
            # Launched, yet some rank never started (a launch lost on its way, a worker that died
            # starting it): its devices are held for nothing. The wait counts from the launch.
            progress = {r: (self.attempt_started_at, None) for r in ranks if r not in self.started}
            median = None
        else:
            return []
        v = hang(
            ts,
            progress,
            median,
            timeout_s=self.spec.hang_timeout_s,
            multiple=self.spec.hang_step_multiple,
            nodes=self.nodes,
        )
        if v is None:
            return []
        if rec is not None:
            v = dataclasses.replace(
                v,
                message=f"hang: the rollback to step {rec.to_step} has not completed after "
                f"{v.evidence['silent_s']:.1f}s (limit {v.evidence['limit_s']:.1f}s)",
                evidence={**v.evidence, "rollback_to": rec.to_step},
            )
        elif not self.running():
            waiting = sorted(progress)
            v = dataclasses.replace(
                v,
                message=f"hang: rank {v.rank} on {v.node} has not started {v.evidence['silent_s']:.1f}s "
                f"after the launch (limit {v.evidence['limit_s']:.1f}s; not started: {waiting})",
                evidence={**v.evidence, "not_started": waiting},
            )
        self.hang_raised = True
        self.recovering = None  # a stuck rollback is abandoned: the hang decision takes over
        return [self.decide(v, now, anomaly_step=v.step, key=round(progress[v.rank or 0][0], 3))]

    # --- persistence --------------------------------------------------------------------------------

    def snapshot(self) -> dict[str, Any]:
        """The control state, JSON-ready (the windows are rebuilt by replay)."""
        return {
            "spec": self.spec.model_dump(mode="json"),
            "world_size": self.world_size,
            "final_step": self.final_step,
            "placement": {str(r): list(p) for r, p in self.placement.items()},
            "attempt": self.attempt,
            "attempt_started_at": self.attempt_started_at,
            "generation": self.generation,
            "gen_started_at": None if math.isinf(self.gen_started_at) else self.gen_started_at,
            "state": self.state,
            "checkpoints": {str(s): p for s, p in self.checkpoints.items()},
            "rollbacks": self.rollbacks,
            "recovering": asdict(self.recovering) if self.recovering else None,
            "started": sorted(self.started),
            "exited": sorted(self.exited),
            "running_since": self.running_since,
            "last_rollback_completed": self.last_rollback_completed,
        }

    @classmethod
    def restore(cls, job_id: str, snap: dict[str, Any]) -> JobWatch:
        w = cls(job_id)
        w.spec = GuardianSpec.model_validate(snap["spec"])
        w.world_size = snap["world_size"]
        w.final_step = snap.get("final_step")  # absent from snapshots saved before it was kept
        w.placement = {int(r): (p[0], int(p[1])) for r, p in snap["placement"].items()}
        w.attempt = snap["attempt"]
        w.attempt_started_at = snap["attempt_started_at"]
        w.generation = snap["generation"]
        w.gen_started_at = -math.inf if snap["gen_started_at"] is None else snap["gen_started_at"]
        w.state = JobState(snap["state"]) if snap["state"] is not None else None
        w.checkpoints = {int(s): p for s, p in snap["checkpoints"].items()}
        w.rollbacks = snap["rollbacks"]
        w.recovering = Recovering(**snap["recovering"]) if snap["recovering"] else None
        w.started = set(snap["started"])
        w.exited = set(snap["exited"])
        w.running_since = snap["running_since"]
        w.last_rollback_completed = snap["last_rollback_completed"]
        w._reset_windows()
        return w

    @property
    def replay_from(self) -> float:
        """Step events created from this time on rebuild the windows after a restart."""
        return max(self.attempt_started_at, self.gen_started_at)
