"""One job as the guardian sees it: its control state (`state.Control`, saved), its detector windows
and the steps held during a recovery (rebuilt after a restart by a quiet replay of its steps).

`JobWatch` is pure: events and the current time go in, `Decision`s come out; the service around it
publishes them. Events come in the order the job's stream stored them (`service.share_input`), so a
launch precedes its ranks' steps, and a rank's checkpoint precedes its next step.

Timelines. After an in-place rollback the ranks re-run steps they already ran. Events of the
abandoned timeline can still arrive late; they were created before the rollback completed, so events
of this attempt created before `gen_started_at` are dropped. While a rollback or halt is in progress
(`recovering`), events created after the decision are held back and judged once the rollback
completes (or the halt ends), so one fault gives one incident.

A hang explained. When a wait lasts too long, the job's stacks are asked for first (`ask_stacks`: a
`DumpStacks` to its workers) and the hang is decided once every node's `StacksDumped` is in, or the bound
(`Settings.hang_stacks_s`) has passed, whichever comes first: the action never waits longer. The incident
names the rank that stands apart and its frame (`vigil_guardian.stacks`), or says why there are no stacks.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime
from typing import assert_never

from vigil.events import (
    CheckpointRefused,
    CheckpointSaved,
    DeviceDiagnosed,
    DumpStacks,
    GuardianSettingsChanged,
    JobStateChanged,
    LaunchJob,
    Message,
    OutOfMemoryHalted,
    RankExited,
    RanksHalted,
    RankStarted,
    ReportRefused,
    RestartJob,
    RestartRequested,
    RollbackCompleted,
    RollbackJob,
    StacksDumped,
    StatusEvent,
    StepCompleted,
    StepReplayed,
)
from vigil.jobstates import JobState
from vigil_guardian.hang import STARTUPS_KEPT, job_hang
from vigil_guardian.policy import (
    Decision,
    Policy,
    diagnosed_incident,
    incident_id,
    out_of_memory,
    replay_incident,
    report_refused,
)
from vigil_guardian.rank_exit import rank_exit
from vigil_guardian.replays import diagnose, diagnosis_verdict, strike
from vigil_guardian.stacks import explained
from vigil_guardian.state import Control, Recovering, Retuned
from vigil_guardian.verdict import Verdict
from vigil_guardian.windows import Windows

EPISODE_GAP = 5  # anomalies of one kind within this many steps of the last one are one episode
BUFFER_MAX = 20_000  # events held back during a recovery


@dataclass
class Episode:
    start: int
    last: int


@dataclass
class StackWait:
    """A hang's `DumpStacks`, out: the nodes' dumps as they come, until all are in or `deadline`."""

    key: tuple[int | None, float]  # the silence asked about: (rank, since)
    command: DumpStacks
    deadline: float  # epoch seconds
    nodes: frozenset[str]
    dumps: dict[str, StacksDumped] = field(default_factory=dict)
    error: str | None = None  # why no dump can come (the command was not published)

    @property
    def complete(self) -> bool:
        return self.nodes <= self.dumps.keys()


def _silence(v: Verdict) -> tuple[int | None, float]:
    return v.rank, v.evidence["since"]


class JobWatch:
    """The guardian's view of one job."""

    def __init__(self, job_id: str, control: Control | None = None) -> None:
        self.job_id = job_id
        self.control = control or Control()
        self._reset_windows()

    def _reset_windows(self) -> None:
        self.windows = Windows(self.control.spec)
        self.windows.checkpoint_every = self.control.checkpoint_every
        self.episodes: dict[str, Episode] = {}
        self.buffer: list[StepCompleted] = []
        self.hang_raised = False
        self.stack_wait: StackWait | None = None

    def _current(self, event: Message) -> bool:
        """Is the event about the current attempt (starting a newer one if it is newer)?"""
        c = self.control
        if event.attempt < c.attempt:
            return False
        if event.attempt > c.attempt:
            c.new_attempt(event.attempt, event.occurred_at.timestamp())
            previous = self.windows
            self._reset_windows()
            self.windows.keep_times(previous)  # until its launch says it runs on another number of ranks
        return True

    # --- events -------------------------------------------------------------------------------------

    def on_launch(self, event: LaunchJob) -> None:
        c = self.control
        if not self._current(event):
            return
        # Settings changed at run time stay: a later launch carries them (the scheduler changed the job's
        # spec with them), and one stored before the change was built without them.
        if event.spec.guardian != c.spec and c.retuned is None:
            c.spec = event.spec.guardian
            self.windows.resize(c.spec)
        c.placement = {p.rank: (p.node, p.device) for p in event.placement}
        c.vouched = event.spec.entrypoint is None  # the built-in trainer: the worker's own program
        if c.world_size is not None and c.world_size != len(event.placement):
            self.windows.forget_times()
        c.world_size = len(event.placement)
        c.final_step = event.spec.train.steps - 1
        c.checkpoint_every = self.windows.checkpoint_every = event.spec.checkpoint.every
        # The wait for its ranks starts here, not at the attempt's first event (a queued job's submission).
        c.launched_at = c.launched_at or event.occurred_at.timestamp()

    def on_step(self, event: StepCompleted, now: datetime, *, quiet: bool = False) -> list[Decision]:
        """Judge one rank's step. `quiet`: rebuild windows only (a replay of events already judged)."""
        c = self.control
        if c.terminal or not self._current(event):
            return []
        t = event.occurred_at.timestamp()
        if c.gen_started_at is not None and t < c.gen_started_at:
            return []  # the abandoned timeline of a rollback
        if (rec := c.recovering) is not None:
            if rec.kind in ("restart", "fail"):
                return []  # this attempt is being ended
            if t >= rec.since:
                if len(self.buffer) < BUFFER_MAX:
                    self.buffer.append(event)
                return []
            quiet = True  # in flight when the decision was made: part of the fault already handled
        return self._judge(event, now, quiet)

    def _judge(self, event: StepCompleted, now: datetime, quiet: bool) -> list[Decision]:
        c = self.control
        c.running_since = c.running_since or event.occurred_at.timestamp()
        self.hang_raised = False
        self._started_up(event)
        if c.retuned is not None and c.retuned.from_step is None and not quiet:
            c.retuned.from_step = event.step  # the first step judged under the changed settings
        out = []
        for v in self.windows.observe(event, c.world_size, c.nodes):
            if c.recovering is not None:
                break  # the first verdict already stopped the job
            if quiet and self._judged_before_retune(event):
                continue  # re-fed under settings it was not judged by: no episode it never had
            if self._new_episode(v) and not quiet:
                out.append(self.decide(v, now, data_position=event.data_position, key=v.step))
        return out

    def _judged_before_retune(self, event: StepCompleted) -> bool:
        """Was the step judged before the job's settings changed (so under others)?"""
        r = self.control.retuned
        return r is not None and (r.from_step is None or event.step < r.from_step)

    def _started_up(self, event: StepCompleted) -> None:
        """A rank's first step of the attempt ends its start-up; the last rank's ends the attempt's, whose
        length (from the launch) the next attempts' start-up limit is learned from."""
        c = self.control
        if event.rank in c.stepped:
            return
        c.stepped.add(event.rank)
        if c.launched_at is not None and c.world_size and len(c.stepped) == c.world_size:
            took = max(0.0, event.occurred_at.timestamp() - c.launched_at)
            c.startups = [*c.startups, round(took, 3)][-STARTUPS_KEPT:]

    def _new_episode(self, v: Verdict) -> bool:
        """One incident per episode of a kind: False when `v` continues the current one."""
        ep, step = self.episodes.get(v.kind), (v.step if v.step is not None else -1)
        if ep is not None and ep.start - EPISODE_GAP <= step <= ep.last + EPISODE_GAP:
            ep.last = max(ep.last, step)
            return False
        self.episodes[v.kind] = Episode(step, step)
        return True

    def on_status(self, event: StatusEvent, now: datetime) -> list[Decision]:
        c = self.control
        match event:
            case CheckpointSaved():  # a saved checkpoint outlives its attempt
                c.checkpoints[event.step] = event.path
                c.checkpoint_bytes = max(c.checkpoint_bytes, event.bytes)  # what a load may read
                return []
            case CheckpointRefused():  # it did not load: never a rollback's target again
                c.checkpoints.pop(event.step, None)
                return []
            case _ if c.terminal:
                return []
            case JobStateChanged():
                return self._on_state(event, now)
            case GuardianSettingsChanged():
                self._retune(event)  # the job's, whatever its attempt
                return []
            case _ if not self._current(event):
                return []
            case RankStarted():
                c.started.add(event.rank)
                if c.world_size and len(c.started) >= c.world_size and c.running_since is None:
                    c.running_since = event.occurred_at.timestamp()
                return []
            case RankExited():
                c.exited.add(event.rank)
                self.windows.progress.pop(event.rank, None)
                v = rank_exit(event)
                return [self.decide(v, now, key=event.rank)] if v else []
            case RanksHalted():
                c.state = JobState.HALTED
                return []
            case OutOfMemoryHalted():
                return [out_of_memory(event)]
            case StepReplayed():
                return self._on_replayed(event, now)
            case ReportRefused():
                return [report_refused(event)]
            case DeviceDiagnosed():
                return self._on_diagnosed(event, now)
            case StacksDumped():
                return self._on_stacks(event, now)
            case RollbackCompleted():
                return self._on_rollback_completed(event, now)
            case RestartRequested():
                return []  # the scheduler relaunches the ranks: the next attempt's events start anew
            case _:
                assert_never(event)

    def _retune(self, event: GuardianSettingsChanged) -> None:
        """Judge the steps from here on under the changed settings (a change already seen: nothing)."""
        c = self.control
        if c.retuned is not None and event.revision <= c.retuned.revision:
            return
        c.spec, c.retuned = event.settings, Retuned(event.revision, dict(event.changed))
        self.windows.resize(c.spec)

    def _on_replayed(self, event: StepReplayed, now: datetime) -> list[Decision]:
        """The ranks held a step and replayed it: the incident, and for a transient fault a strike on each
        culprit's device; a device at `sdc_strikes` strikes is excluded (the job relaunched without it)."""
        c = self.control
        self.windows.held.append(event.step)  # its wait held a replay: no step time
        if event.outcome == "transient" and not c.vouched:
            # A user program's word: evidence for the worker's check of each device, never a strike.
            asks = [a for r in event.culprits if (a := diagnose(c, r, event)) is not None]
            return [replay_incident(event, c.placement, asks)]
        out = [replay_incident(event, c.placement)]
        if event.outcome != "transient":
            return out
        for rank in event.culprits:
            if (where := c.placement.get(rank)) is None:
                continue
            verdict = strike(c, where, rank, event)
            if verdict is not None and c.recovering is None:
                out.append(self.decide(verdict, now, anomaly_step=event.step, key=event.event_id))
        return out

    def _on_diagnosed(self, event: DeviceDiagnosed, now: datetime) -> list[Decision]:
        """The worker's check of a device a user program's replay named: a failure is an `sdc` verdict
        (the job relaunched without the device); a pass, an alert that the report was not upheld."""
        c = self.control
        asked = c.diagnoses.get(f"{event.node}:{event.device}")
        rank = next((r for r, where in c.placement.items() if where == (event.node, event.device)), None)
        if event.passed is not False:
            return [diagnosed_incident(event, rank)]
        verdict = diagnosis_verdict(event, rank, asked[1] if asked else None)
        if c.recovering is not None or rank is None:
            return [diagnosed_incident(event, rank, verdict)]  # recorded; the scheduler marks it anyway
        return [self.decide(verdict, now, anomaly_step=verdict.step, key=event.event_id)]

    def _on_state(self, event: JobStateChanged, now: datetime) -> list[Decision]:
        c = self.control
        if event.attempt and not self._current(event):
            return []
        was, c.state = c.state, event.to_state
        if event.to_state != JobState.RUNNING or was == JobState.RUNNING:
            return []
        t = c.running_since = event.occurred_at.timestamp()
        self.windows.progress = {r: (t, p[1]) for r, p in self.windows.progress.items()}  # waits restart
        self.hang_raised = False
        if c.recovering is not None and c.recovering.kind == "halt":
            return self._release(None, now)  # resumed after a halt: the timeline goes on
        return []

    def _on_rollback_completed(self, event: RollbackCompleted, now: datetime) -> list[Decision]:
        c = self.control
        if event.event_id == c.last_rollback_completed:
            return []
        c.last_rollback_completed = event.event_id
        rec, to, t = c.recovering, event.to_step, event.occurred_at.timestamp()
        refused = rec.checkpoint if rec is not None and rec.checkpoint != event.checkpoint else None
        # Later checkpoints are abandoned; one the ranks refused (corrupt, they used an earlier one) too.
        c.checkpoints = {s: p for s, p in c.checkpoints.items() if s <= to and p != refused}
        c.generation, c.gen_started_at = c.generation + 1, t
        self.windows.rewind(to, t, c.live_ranks)
        self.episodes.clear()
        self.hang_raised = False
        c.state, c.running_since = JobState.RUNNING, t
        return self._release(t, now)

    def _release(self, created_after: float | None, now: datetime) -> list[Decision]:
        """End a recovery and judge the events held back during it."""
        held, self.buffer, self.control.recovering = self.buffer, [], None
        out: list[Decision] = []
        for e in held:
            if (created_after is None or e.occurred_at.timestamp() >= created_after) and (
                e.attempt == self.control.attempt
            ):
                if self.control.recovering is None:
                    out += self._judge(e, now, quiet=False)
                elif len(self.buffer) < BUFFER_MAX:
                    self.buffer.append(e)
        return out

    def hang_verdict(self, now: datetime) -> Verdict | None:
        """The hang this job is in now, if one is not raised already (nothing changes)."""
        if self.hang_raised:
            return None
        return job_hang(self.control, self.windows.progress, self.windows.p99_wait_s(), now.timestamp())

    def ask_stacks(self, now: datetime, within_s: float) -> DumpStacks | None:
        """The `DumpStacks` to send for the hang this job is in now, once per silence; None when there is
        no hang, it was asked already, or no node of a live rank is known."""
        v = self.hang_verdict(now)
        if v is None or within_s <= 0 or "not_started" in v.evidence:
            return None
        if self.stack_wait is not None and self.stack_wait.key == _silence(v):
            return None
        c = self.control
        nodes = frozenset(c.nodes[r] for r in c.live_ranks if r in c.nodes)
        if not nodes:
            return None
        command = DumpStacks(
            event_id=f"{self._incident_id(v)}-stacks",
            job_id=self.job_id,
            attempt=c.attempt,
            occurred_at=now,
            within_s=within_s,
            reason=v.message[:2000],
        )
        self.stack_wait = StackWait(_silence(v), command, now.timestamp() + within_s, nodes)
        return command

    def stacks_not_asked(self, why: str, now: datetime) -> None:
        """The `DumpStacks` could not be sent: the hang is decided without stacks, at once."""
        if self.stack_wait is not None:
            self.stack_wait.error = f"the dump was not asked for: {why}"[:500]
            self.stack_wait.deadline = now.timestamp()

    def _on_stacks(self, event: StacksDumped, now: datetime) -> list[Decision]:
        w = self.stack_wait
        if w is None or event.command_id != w.command.event_id:
            return []  # a dump for a silence decided already (or one this guardian did not ask)
        w.dumps[event.node] = event
        return self.check_hang(now) if w.complete else []

    def check_hang(self, now: datetime) -> list[Decision]:
        """A hang decision if some wait has lasted too long (called on a timer; see `hang.job_hang`), once
        the stacks asked for are in or their bound has passed."""
        v = self.hang_verdict(now)
        if v is None:
            return []
        w = self.stack_wait
        if w is not None and w.key != _silence(v):
            w = self.stack_wait = None  # asked about an earlier silence
        if w is not None and not w.complete and now.timestamp() < w.deadline:
            return []  # the dumps have until the deadline
        iid = self._incident_id(v)
        if w is not None:
            error = w.error or f"no dump came within {w.command.within_s:.1f}s"
            v = explained(v, w.dumps.values(), self.control.live_ranks, self.control.nodes, error=error)
        self.stack_wait = None
        self.hang_raised = True
        self.control.recovering = None  # a stuck rollback is abandoned: the hang decision takes over
        return [self.decide(v, now, anomaly_step=v.step, key=v.evidence["since"], iid=iid)]

    def _incident_id(self, v: Verdict) -> str:
        """A hang's incident id, from the silence the detector found (not the rank its stacks name)."""
        c = self.control
        since = v.evidence["since"]
        return incident_id(self.job_id, c.attempt, c.generation, v.kind, since, v.rank, v.node, v.device)

    # --- deciding -------------------------------------------------------------------------------------

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
        """The job's policy's decision on a verdict, its effect applied to the job (`iid`: its incident's
        id, when not the one of `key` and the verdict's place)."""
        c = self.control
        iid = iid or incident_id(self.job_id, c.attempt, c.generation, v.kind, key, v.rank, v.node, v.device)
        d = Policy(c.spec, c.retuned.evidence() if c.retuned else None).decide(
            v,
            iid=iid,
            job_id=self.job_id,
            attempt=c.attempt,
            checkpoints=c.checkpoints,
            rollbacks=c.rollbacks,
            now=now,
            anomaly_step=anomaly_step,
            data_position=data_position,
        )
        match d.action:
            case "rollback" | "restart":  # one recovery toward max_rollbacks, in place or relaunched
                c.rollbacks += 1
                target = next(cmd for cmd in d.commands if isinstance(cmd, RollbackJob | RestartJob))
                c.recovering = Recovering(d.action, now.timestamp(), target.step, target.checkpoint)
            case "halt" | "fail":
                c.recovering = Recovering(d.action, now.timestamp())
            case "alert" | "replay" | "skip":
                pass
            case _:
                assert_never(d.action)
        return d
