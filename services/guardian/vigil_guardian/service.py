"""One share's judging: its input, and the I/O around the pure `Guardian` core (take the share up,
publish decisions, save state, the hang check).

One ordered input per share. A share's job events come through one durable consumer of VIGIL_JOBS
(`share_input`, filtered on the share's stored subjects), in the order the server stored them, and are
judged in that order: a job's launch before its steps, a rank's checkpoint before its next step, a
rollback's completion before the steps after it.

Taking a share up (`GuardianService.run_share`, after a restart or a hand-over alike) restores it: its
saved state and cursor (`cursor_key`), then a re-feed of each active job's steps that its input has
acknowledged into the detector windows, quietly (no decision: their effect is in the saved state). A
re-feed is not a replay, which re-runs a held step on the ranks. First start: a share with no consumer
and no saved state (a new deployment, or one started after its jobs) replays the last
`guardian_replay_s` of job events, so it judges a running job from its start; jobs that ended within
that window are not judged at all.

Judged once. Two sequences of that input say where a share stands: `judged` (every event up to it has
had its effect) and `windowed` (every step up to it is in the detector windows). The judged sequence is
saved with the job state it changed, in one transaction; after a restart or a hand-over an event up to it
is not judged again (a step only goes back into the windows), and a redelivered event up to `windowed` is
skipped.

A decision goes out as its commands on `subjects.cmd(job)` first (they stop the damage), then its
`IncidentRaised` (`outgoing`); the state and incident are saved, and only then is the batch acknowledged. A
decision that cannot be published yet (NATS away) is retried in place, and nothing after it is judged
until it is out: the order holds. A message the server refuses for good (`PublishRefused`: too large,
a bad subject) is never retried: its incident goes out truncated (`oversize.truncated`), and what still
does not fit is dead-lettered, so one such message cannot stop the share's judging. Ids are stable
per fault, so a crash between publishing and saving republishes the same ids (JetStream drops them).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
from collections.abc import Awaitable, Callable
from datetime import datetime

import asyncpg

from vigil.errors import PublishRefused, RetryableError
from vigil.events import (
    Command,
    GpuSampled,
    IncidentRaised,
    JobStateChanged,
    Message,
    MessageDeadLettered,
    StepCompleted,
    expect,
    is_guardian_input,
    utcnow,
)
from vigil.jobstates import TERMINAL_STATES
from vigil_common import credentials, subjects
from vigil_common.bus import Bus, ConsumerSpec, Delivery
from vigil_common.origin import Origins
from vigil_common.service import wait_any
from vigil_guardian import store
from vigil_guardian.core import Guardian
from vigil_guardian.notifier import Notifier
from vigil_guardian.oversize import truncated
from vigil_guardian.policy import Decision
from vigil_guardian.state import Control
from vigil_guardian.verdict import Verdict
from vigil_guardian.watch import JobWatch

log = logging.getLogger(__name__)

HANG_CHECK_S = 0.5
RETRY_MAX_S = 5.0
REFEED_HORIZON_S = 3600.0  # the windows hold the last few dozen steps per rank: an hour rebuilds them


# --- a share's input ----------------------------------------------------------------------------------


def share_input(share: int) -> ConsumerSpec:
    """The durable consumer of one share's job events."""
    return ConsumerSpec(
        stream=subjects.JOBS,
        durable=credentials.guardian_input(share),
        filter_subject=subjects.share_events(share),
    )


INPUTS = tuple(share_input(k) for k in range(subjects.SHARES))


def job_input(job_id: str) -> ConsumerSpec:
    """The consumer that judges a job's events: its share's."""
    return share_input(subjects.share_of(job_id))


def cursor_key(share: int) -> str:
    """Where a share's judged sequence is saved (`guardian_cursor.stream`): a VIGIL_JOBS sequence. (The
    cursors of the release that read a copy, `VIGIL_SHARES/<share>`, count another stream's sequences:
    not read, see `GuardianService.restore`.)"""
    return f"{subjects.JOBS.name}/{subjects.check_share(share)}"


async def last_stored(bus: Bus, job_id: str) -> int | None:
    """The VIGIL_JOBS sequence of the last event stored of the job (its share's input reads that stream);
    None when there is none."""
    last = await bus.last_stored(subjects.JOBS.name, subjects.job_events(job_id))
    return last.seq if last is not None else None


async def input_idle(bus: Bus, spec: ConsumerSpec) -> bool:
    with contextlib.suppress(RetryableError):
        state = await bus.consumer_state(spec)
        return state is not None and state.idle
    return False


# --- a decision's messages ----------------------------------------------------------------------------


def outgoing(decision: Decision) -> list[tuple[str, IncidentRaised | Command]]:
    """A decision's messages as (subject, message), in publish order. Commands go first (they are what
    stops the damage), except for `fail`, whose incident goes first so that the scheduler records FAILED,
    not CANCELLED."""
    incident = decision.incident
    job = incident.job_id
    inc_subject = subjects.incident(job) if job else subjects.node_incident(incident.node or "unknown")
    cmds: list[tuple[str, IncidentRaised | Command]] = (
        [(subjects.cmd(job), c) for c in decision.commands] if job else []
    )
    inc: list[tuple[str, IncidentRaised | Command]] = [(inc_subject, incident)]
    return inc + cmds if decision.action == "fail" else cmds + inc


class GuardianService:
    """The I/O around the pure `Guardian`: publish decisions, save state, notify."""

    def __init__(
        self,
        core: Guardian,
        bus: Bus,
        pool: asyncpg.Pool,
        notifier: Notifier,
        *,
        share: int = 0,
        publish_timeout_s: float = 10.0,
        stacks_s: float = 2.0,
    ) -> None:
        self.core = core
        self.share = share
        self.input = share_input(share)
        self.bus = bus
        self.origins = Origins(bus)
        self.pool = pool
        self.notifier = notifier
        self.publish_timeout_s = publish_timeout_s
        self.fence: store.Fence | None = None  # the share's epoch this service holds (`store.take_epoch`)
        self.stacks_s = stacks_s  # a hang's action waits this long for the ranks' stacks (0: none asked)
        self.judged = 0  # input sequence: every event up to here has had its effect
        self.windowed = 0  # input sequence: every step up to here is in the windows
        self.caught_up = asyncio.Event()  # the input has delivered all it held at start: hangs count
        self._saved: dict[str, dict] = {}  # the last snapshot written per job
        self._devices = core.device_levels()
        self._lock = asyncio.Lock()  # one save at a time
        self._publishing = asyncio.Lock()  # one publisher of the owed decisions at a time
        # Decided but not yet published, and incidents published but not yet saved.
        self._owed: list[Decision] = []
        self._unsaved: list[IncidentRaised] = []

    # --- taking the share up ------------------------------------------------------------------------

    async def run_share(self, replay_s: float, until: asyncio.Event) -> None:
        """Restore the share (saved state and cursor, as after a restart: a hand-over is one); judge its
        input until `until`."""
        spec = await self.restore(replay_s)
        async with asyncio.TaskGroup() as tasks:
            # a step or status event counts only from the node its launch placed it on
            tasks.create_task(
                self.bus.consume_batches(
                    spec, lambda b: self.on_jobs(b, until), until, gather_s=0, admit=self.origins.admit
                )
            )
            tasks.create_task(self.hang_loop(until))

    async def restore(self, replay_s: float) -> ConsumerSpec:
        """Load the share's saved state and rebuild each active job's windows from the steps its input has
        acknowledged; returns the input's spec (a first start: a bounded replay)."""
        share, spec, core = self.share, self.input, self.core
        saved = await store.load(self.pool, cursor_key(share), share)
        for job_id in saved.finished:
            core.finish(job_id)
        for iid in saved.incidents:
            core.mark_published(iid)
        core.restore_devices(saved.devices)
        self._devices = core.device_levels()
        for job_id, snap in saved.jobs.items():
            core.jobs[job_id] = JobWatch(job_id, Control.restore(snap))
            self._saved[job_id] = snap
        self.judged = saved.cursor or 0
        state = await self.bus.consumer_state(spec)
        if state is None:
            if saved.jobs and saved.cursor is None:
                # State saved by a guardian of an earlier layout (before shares, one input for all jobs; or
                # reading VIGIL_SHARES, the copy): its cursor counts another stream's sequences. It judged up
                # to now, so this share starts at new events, as that one would have.
                return dataclasses.replace(spec, deliver_new=True)
            since = utcnow().timestamp() - replay_s
            ended = await self._ended_since(since)
            for job_id in ended:
                if job_id not in core.jobs:
                    core.finish(job_id)
            log.info(
                "guardian: share %d: first start, replaying %.0fs of job events (%d jobs ended)",
                share,
                replay_s,
                len(ended),
            )
            return dataclasses.replace(spec, replay_s=replay_s)
        self.windowed = upto = state.acked
        refed = 0
        for watch in list(core.jobs.values()):
            refed += await self.refeed(watch, upto)
        if saved.jobs:
            log.info("guardian: share %d: restored %d jobs, refed %d steps", share, len(saved.jobs), refed)
        return spec

    async def _ended_since(self, since: float) -> set[str]:
        """The share's jobs whose last state change since `since` ended them."""
        last: dict[str, bool] = {}
        admit = Origins(self.bus).admit
        name = credentials.guardian_scan(self.share)
        async for event in self.bus.scan(name, subjects.CONTROL_STATUS, since=since, admit=admit):
            if (
                isinstance(event, JobStateChanged)
                and event.job_id
                and subjects.share_of(event.job_id) == self.share
            ):
                last[event.job_id] = event.to_state in TERMINAL_STATES
        return {job for job, ended in last.items() if ended}

    async def refeed(self, watch: JobWatch, upto: int) -> int:
        """Feed a job's step events (share input sequence <= `upto`) quietly: windows only, no decisions."""
        if upto <= 0:
            return 0
        since = max(watch.control.replay_from, utcnow().timestamp() - REFEED_HORIZON_S)
        fed = 0
        steps = subjects.job_steps(watch.job_id)
        name = credentials.guardian_scan(self.share)
        async for event in self.bus.scan(name, steps, since=since, upto=upto, admit=self.origins.admit):
            if isinstance(event, StepCompleted):  # all a step subject carries (`subjects.CARRIES`)
                self.core.on_event(event, event.occurred_at, quiet=True)
                fed += 1
        return fed

    # --- the inputs ---------------------------------------------------------------------------------

    async def on_jobs(self, batch: list[tuple[Message, Delivery]], stop: asyncio.Event | None = None) -> None:
        """Judge a batch of job events in stream order; publish each decision as it is made; save."""
        touched: set[str] = set()
        for event, delivery in batch:
            seq = delivery.stream_seq
            if seq <= self.windowed:
                continue  # redelivered: judged already
            self.windowed = seq
            quiet = seq <= self.judged
            if quiet and not isinstance(event, StepCompleted):
                continue  # its effect is in the saved state
            if not is_guardian_input(event):  # the input decodes only job events (`subjects.CARRIES`)
                log.error(
                    "guardian: %s %s on %s is no job event: not judged",
                    event.type,
                    event.event_id,
                    delivery.subject,
                )
                continue
            decisions = self.core.on_event(event, utcnow(), quiet=quiet)
            self.judged = max(self.judged, seq)
            if event.job_id:
                touched.add(event.job_id)
            if decisions or self._owed:
                self._owed += decisions
                await self._retrying(self.publish_owed, stop)
        await self._retrying(lambda: self.persist(touched, cursor=self.judged), stop)
        if batch and batch[-1][1].num_pending == 0:
            self.caught_up.set()

    async def on_device_verdicts(
        self, verdicts: list[tuple[GpuSampled, Verdict]], stop: asyncio.Event | None = None
    ) -> None:
        """Decide about the device verdicts handed to this share (its guardian judged the samples once,
        `vigil_guardian.devices`); publish; share 0 saves the device levels."""
        decided = []
        for sample, verdict in verdicts:
            decided += self.core.judge_device(sample, verdict, utcnow())
        for d in decided:
            i = d.incident  # share 0's decision on a device that may run another share's job: theirs
            idle = i.job_id is None and i.node is not None and i.device is not None
            if idle and await store.device_busy(self.pool, i.node or "", i.device or 0):
                continue
            self._owed.append(d)
        if self._owed:
            await self._retrying(self.publish_owed, stop)
        # share 0 saves the device levels (its guardian's, one for every share it holds)
        await self._retrying(lambda: self.persist(set(), devices=self.share == 0), stop)

    async def handle(self, event: Message) -> None:
        """Judge one event outside the input (tests, tools): publish and save what it decides."""
        self._owed += self.core.on_event(expect(event, is_guardian_input, "guardian input"), utcnow())
        await self.publish_owed()
        await self.persist({event.job_id} if event.job_id else set(), devices=isinstance(event, GpuSampled))

    async def _retrying(self, attempt: Callable[[], Awaitable[None]], stop: asyncio.Event | None) -> None:
        """Run `attempt` until it succeeds; without `stop` (a direct caller), once."""
        delay = 0.1
        while True:
            try:
                return await attempt()
            except store.Fenced as exc:  # another guardian holds the share now: never again here
                log.error("guardian: %s; judging it no more", exc)
                if stop is not None:
                    stop.set()
                raise
            except Exception as exc:
                if stop is None or stop.is_set():
                    raise
                log.warning("guardian: %s; judging waits, retrying in %.1fs", exc, delay)
            await wait_any(stop, timeout_s=delay)
            delay = min(delay * 2, RETRY_MAX_S)

    # --- publishing and saving ----------------------------------------------------------------------

    async def publish_owed(self) -> None:
        """Publish the decisions owed, oldest first; one that fails stays owed with those after it. The
        job input and the device verdicts both call this: one at a time, or both would publish the head
        decision (twice) and the second pop would find the list empty."""
        async with self._publishing:
            await self._publish_owed()

    async def _publish_owed(self) -> None:
        if self._owed and self.fence is not None:  # a holder fenced off decides nothing any more
            await store.check_fence(self.pool, self.fence)
        while self._owed:
            d = self._owed[0]
            incident = d.incident
            for subject, message in outgoing(d):
                sent = await self._publish(subject, message)
                if message is d.incident and isinstance(sent, IncidentRaised):
                    incident = sent
            self._owed.pop(0)
            self._unsaved.append(incident)
            self.core.mark_published(incident.event_id)
            self.notifier.notify(incident)
            log.warning(
                "incident %s %s -> %s: %s",
                incident.job_id or incident.node,
                incident.kind,
                d.action,
                incident.message[:1000],
            )

    async def _publish(self, subject: str, message: IncidentRaised | Command) -> Message | None:
        """Publish one message of a decision: as it is, or, refused for good, its incident truncated;
        what still does not go out is dead-lettered. The message published (None: dead-lettered)."""
        try:
            await self.bus.publish(subject, message, timeout_s=self.publish_timeout_s)
            return message
        except PublishRefused as exc:
            refused = exc
        if isinstance(message, IncidentRaised):
            cut = truncated(message)
            log.error("guardian: incident %s refused (%s); sending it truncated", message.event_id, refused)
            try:
                await self.bus.publish(subject, cut, timeout_s=self.publish_timeout_s)
                return cut
            except PublishRefused as exc:
                refused = exc
        await self._dead_letter(subject, message, str(refused))
        return None

    async def _dead_letter(self, subject: str, message: Message, reason: str) -> None:
        """Record a message of a decision that the bus refused for good, instead of publishing it."""
        log.error("guardian: dead-lettering %s %s (%s): %s", message.type, message.event_id, subject, reason)
        try:
            stream = subjects.stream_for(subject).name
        except ValueError:  # a subject no stream stores (the refusal's reason, likely)
            stream = subjects.INCIDENTS.name
        letter = MessageDeadLettered(
            event_id=f"dl-guardian-{message.event_id}"[:128],
            job_id=message.job_id,
            attempt=message.attempt,
            stream=stream,
            consumer=self.input.durable,
            subject=subject,
            reason=reason[:4000],
            payload=message.to_bytes()[:100_000].decode("utf-8", errors="replace"),
            num_delivered=0,
        )
        try:
            await self.bus.publish(subjects.dead_letter(stream), letter, timeout_s=self.publish_timeout_s)
        except PublishRefused as exc:  # nothing more to try: the log line above is the record
            log.error("guardian: the dead letter of %s was refused too: %s", message.event_id, exc)

    async def persist(self, job_ids: set[str], *, devices: bool = False, cursor: int | None = None) -> None:
        """Save, in one transaction, the changed snapshots of `job_ids` and of the jobs decided about,
        the incidents published since the last save and, with `devices`, the device levels; with
        them (never alone: a step that changes nothing writes nothing) the input `cursor`."""
        async with self._lock:
            job_ids = job_ids | {i.job_id for i in self._unsaved if i.job_id}
            rows = []
            for job_id in sorted(job_ids):
                watch = self.core.jobs.get(job_id)
                if watch is not None:
                    snap, terminal = watch.control.snapshot(), False
                elif job_id in self.core.finished and job_id in self._saved:
                    snap, terminal = self._saved[job_id], True  # ended: written once, never loaded again
                else:
                    continue
                if self._saved.get(job_id) != snap or terminal:
                    rows.append((job_id, snap, terminal))
            levels = self.core.device_levels() if devices else None
            if levels == self._devices:
                levels = None
            incidents = list(self._unsaved)
            if not rows and not incidents and levels is None:
                return
            await store.save(
                self.pool,
                jobs=rows,
                applied=[a for job_id, snap, _ in rows if (a := self._newly_applied(job_id, snap))],
                incidents=incidents,
                devices=levels,
                cursor=(cursor_key(self.share), cursor) if cursor else None,
                fence=self.fence,
            )
            del self._unsaved[: len(incidents)]
            for job_id, snap, terminal in rows:
                if terminal:
                    self._saved.pop(job_id, None)
                else:
                    self._saved[job_id] = snap
            if levels is not None:
                self._devices = levels

    def _newly_applied(self, job_id: str, snap: dict) -> tuple[str, int, int] | None:
        """(job, revision, step) when the snapshot is the first to say from which step the job's latest
        settings change applies (`state.Retuned`): recorded with it, for the console's curve."""
        now, before = snap.get("retuned"), (self._saved.get(job_id) or {}).get("retuned")
        if now is None or now["from_step"] is None or now == before:
            return None
        return job_id, now["revision"], now["from_step"]

    async def hang_loop(self, stop: asyncio.Event) -> None:
        """Check for hangs on a timer, once the input has caught up (before that, the last steps
        known are old ones, not silences). A job that looks silent is judged only once its share has
        judged the last event VIGIL_JOBS holds of it (`_judged_last`): an input behind is no silence."""
        while not stop.is_set():
            if self.caught_up.is_set() or await input_idle(self.bus, self.input):
                self.caught_up.set()
                now = utcnow()
                silent = [job for job in self.core.hang_candidates(now) if await self._judged_last(job)]
                await self.ask_stacks(now, silent)
                self._owed += self.core.check_hangs(now, silent)
                if self._owed:
                    try:
                        await self.publish_owed()
                        await self.persist(set())
                    except Exception as exc:  # owed still: the next tick tries again
                        log.warning("guardian: publishing decisions failed, will retry: %s", exc)
            await wait_any(stop, timeout_s=HANG_CHECK_S)

    async def ask_stacks(self, now: datetime, job_ids: list[str]) -> None:
        """Before a hang is decided, ask its workers for the ranks' stacks (`DumpStacks`); the decision
        waits for them `stacks_s` at most (`JobWatch.check_hang`), and at once when the ask fails."""
        for command in self.core.ask_stacks(now, job_ids, self.stacks_s):
            job = str(command.job_id)
            try:
                await self.bus.publish(subjects.cmd(job), command, timeout_s=self.stacks_s)
            except Exception as exc:
                log.warning("guardian: %s: the stacks were not asked for: %s", job, exc)
                if (watch := self.core.jobs.get(job)) is not None:
                    watch.stacks_not_asked(str(exc), now)

    async def _judged_last(self, job_id: str) -> bool:
        """Whether this share has judged the last event VIGIL_JOBS stored of the job."""
        try:
            seq = await last_stored(self.bus, job_id)
        except RetryableError:
            return False
        if seq is None or seq > max(self.judged, self.windowed):  # windowed: acked
            log.info("guardian: %s: its last event is not judged yet, so its silence is not either", job_id)
            return False
        return True
