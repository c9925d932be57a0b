"""The guardian service: watches every step, GPU sample and status event, decides, and commands.

Lifecycle: connect, load saved state and rebuild the detector windows (a quiet replay of each
active job's steps up to what the durable consumer has acknowledged), then consume launches,
status, steps and GPU samples in one TaskGroup with a hang check on a timer and the webhook
notifier, until `stop`; drain and close.

A decision goes out as its commands on `subjects.cmd(job)` first (they stop the damage), then
its `IncidentRaised` on `subjects.incident(job)`; then the job's control state and the incident
id are saved, and only then is the event that caused it acknowledged. Ids are stable per fault,
so a crash between publishing and saving republishes the same ids (JetStream drops them). An
event is judged once: a decision whose publishing fails stays owed, and goes out before anything
newer on the next try (the event's redelivery, another event, or the hang timer).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from datetime import datetime, timedelta

import asyncpg
import nats.errors
import nats.js.errors
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy

from vigil_common import subjects
from vigil_common.bus import Bus, ConsumerSpec, Delivery
from vigil_common.errors import MalformedMessage
from vigil_common.events import GpuSampled, IncidentRaised, Message, StepCompleted, decode, utcnow
from vigil_common.service import connect as service_connect
from vigil_common.service import wait_any
from vigil_common.settings import Settings
from vigil_guardian import store
from vigil_guardian.fleet import Guardian
from vigil_guardian.notifier import Notifier
from vigil_guardian.policy import Decision
from vigil_guardian.watch import JobWatch

log = logging.getLogger(__name__)

STEPS = ConsumerSpec(
    stream=subjects.STEPS, durable="guardian-steps", filter_subject=subjects.ALL_STEPS, deliver_new=True
)
GPU = ConsumerSpec(
    stream=subjects.NODES, durable="guardian-gpu", filter_subject=subjects.ALL_GPU, deliver_new=True
)
STATUS = ConsumerSpec(
    stream=subjects.JOBS, durable="guardian-status", filter_subject=subjects.ALL_STATUS, deliver_new=True
)
LAUNCHES = ConsumerSpec(
    stream=subjects.JOBS, durable="guardian-launches", filter_subject=subjects.ALL_LAUNCHES, deliver_new=True
)
HANG_CHECK_S = 0.5
REPLAY_HORIZON_S = 3600.0


class GuardianService:
    """The I/O around the pure `Guardian`: publish decisions, save state, notify."""

    def __init__(
        self,
        core: Guardian,
        bus: Bus,
        pool: asyncpg.Pool,
        notifier: Notifier,
        *,
        publish_timeout_s: float = 10.0,
    ) -> None:
        self.core = core
        self.bus = bus
        self.pool = pool
        self.notifier = notifier
        self.publish_timeout_s = publish_timeout_s
        self._saved: dict[str, dict] = {}  # the last snapshot written per job
        self._devices = core.device_levels()
        self._lock = asyncio.Lock()
        # Decided but not yet published (an attempt failed), with their `sync`; and incidents
        # published but not yet saved. An event is judged once, so these must outlive a failure.
        self._owed: list[tuple[Decision, bool]] = []
        self._unsaved: list[IncidentRaised] = []

    async def handle(self, event: Message, delivery: Delivery | None = None) -> None:
        """Judge one event; publish and save what it decides before it is acknowledged."""
        job = event.job_id
        watch = self.core.jobs.get(job) if job else None
        mark = _mark(watch)
        decisions = self.core.on_event(event, utcnow())
        if (
            isinstance(event, StepCompleted)
            and not decisions
            and not self._owed
            and not self._unsaved
            and watch is not None
            and _mark(watch) == mark
        ):
            return  # the common case: a step that changes nothing but the windows
        await self.settle(
            decisions,
            {job} if job else set(),
            sync=isinstance(event, StepCompleted | GpuSampled),
            devices=isinstance(event, GpuSampled),
        )

    async def settle(
        self, decisions: list[Decision], job_ids: set[str], *, sync: bool = True, devices: bool = False
    ) -> None:
        """Publish `decisions`, after any still owed from a failed attempt, then save the state of
        `job_ids` and of the jobs decided about.

        When publishing fails, what is left stays owed and the error propagates (the event is
        nak'd): the next call, be it the event's redelivery, another event or the hang timer,
        publishes it first. Without that, a redelivered event would find itself already judged
        and its halt would never go out.
        """
        todo, self._owed = self._owed + [(d, sync) for d in decisions], []
        published: list[Decision] = []
        try:
            for d, d_sync in todo:
                published.append(await self.act(d, sync=d_sync))
        except BaseException:
            self._owed = todo[len(published) :] + self._owed
            raise
        finally:
            self._unsaved += [d.incident for d in published]
        job_ids = job_ids | {d.incident.job_id for d in published if d.incident.job_id}
        await self.persist(job_ids, devices=devices)

    async def act(self, d: Decision, *, sync: bool = True) -> Decision:
        """Publish one decision; returns it as published.

        With `sync`, a decision that names a checkpoint is made again once the status and launch
        consumers have handled what is already in their streams (a CheckpointSaved published just
        before the faulty step may not be known yet); its HaltJob goes out before that wait.
        """
        messages = d.messages()
        watch = self.core.jobs.get(d.incident.job_id or "")
        if sync and watch is not None and d.action in ("rollback", "halt") and "redo" in d.effects:
            if messages[0][1].type == "job.halt":
                await self.bus.publish(*messages[0], timeout_s=self.publish_timeout_s)
            await self.caught_up()
            d = watch.refresh(d)
            messages = d.messages()  # a HaltJob sent already is dropped by JetStream as a duplicate
        for subject, message in messages:
            await self.bus.publish(subject, message, timeout_s=self.publish_timeout_s)
        self.core.mark_published(d.incident.event_id)
        self.notifier.notify(d.incident)
        log.warning(
            "incident %s %s -> %s: %s",
            d.incident.job_id or d.incident.node,
            d.incident.kind,
            d.action,
            d.incident.message,
        )
        return d

    async def caught_up(self, timeout_s: float = 2.0) -> None:
        """Wait (at most `timeout_s`) until the status and launch consumers have nothing pending."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while True:
            behind = 0
            for spec in (STATUS, LAUNCHES):
                with contextlib.suppress(nats.errors.Error, nats.js.errors.Error, TimeoutError):
                    info = await self.bus.js.consumer_info(spec.stream.name, spec.durable)
                    behind += info.num_pending + info.num_ack_pending
            if not behind or loop.time() > deadline:
                return
            await asyncio.sleep(0.01)  # the other consumers are working: look again shortly

    async def persist(self, job_ids: set[str], *, devices: bool = False) -> None:
        """Save the changed snapshots of `job_ids`, the incidents published since the last save and,
        with `devices`, the device levels, in one transaction."""
        async with self._lock:
            rows = []
            for job_id in sorted(job_ids):
                watch = self.core.jobs.get(job_id)
                if watch is not None:
                    snap, terminal = watch.snapshot(), False
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
            await store.save(self.pool, jobs=rows, incidents=incidents, devices=levels)
            del self._unsaved[: len(incidents)]
            for job_id, snap, terminal in rows:
                if terminal:
                    self._saved.pop(job_id, None)
                else:
                    self._saved[job_id] = snap
            if levels is not None:
                self._devices = levels

    async def hang_loop(self, stop: asyncio.Event) -> None:
        """Check for hangs on a timer, and publish anything still owed."""
        while not stop.is_set():
            decisions = self.core.check_hangs(utcnow())
            if decisions or self._owed:
                try:
                    await self.settle(decisions, set())
                except Exception as exc:  # owed still: the next tick tries again
                    log.warning("guardian: publishing decisions failed, will retry: %s", exc)
            await wait_any(stop, timeout_s=HANG_CHECK_S)

    def remember(self, job_id: str, snap: dict) -> None:
        self._saved[job_id] = snap


def _mark(watch: JobWatch | None) -> tuple[object, ...] | None:
    """What a step can change in a job's saved state besides its decisions."""
    if watch is None:
        return None
    return (
        watch.attempt,
        watch.running_since is None,
        watch.generation,
        watch.recovering is None,
        watch.state,
    )


async def restore(service: GuardianService, bus: Bus, pool: asyncpg.Pool) -> None:
    """Load saved state, then rebuild each active job's windows from the steps it has already judged."""
    saved = await store.load(pool)
    core = service.core
    for job_id in saved.finished:
        core.finish(job_id)
    for iid in saved.incidents:
        core.mark_published(iid)
    core.restore_devices(saved.devices)
    service._devices = core.device_levels()
    for job_id, snap in saved.jobs.items():
        core.jobs[job_id] = JobWatch.restore(job_id, snap)
        service.remember(job_id, snap)
    try:
        info = await bus.js.consumer_info(STEPS.stream.name, STEPS.durable)
    except nats.js.errors.NotFoundError:
        return  # never consumed: nothing was judged
    upto = info.ack_floor.stream_seq
    replayed = 0
    for watch in list(core.jobs.values()):
        replayed += await _replay(bus, core, watch, upto)
    if saved.jobs:
        log.info("guardian: restored %d jobs, replayed %d step events", len(saved.jobs), replayed)


async def _replay(bus: Bus, core: Guardian, watch: JobWatch, upto: int) -> int:
    """Feed a job's step events (stream sequence <= `upto`) quietly: windows only, no decisions."""
    if upto <= 0:
        return 0
    # The windows hold the last few dozen steps per rank: an hour of steps is plenty to rebuild them.
    since = max(watch.replay_from, utcnow().timestamp() - REPLAY_HORIZON_S, 0.0)
    start = datetime.fromtimestamp(since, tz=utcnow().tzinfo) - timedelta(seconds=1)
    config = ConsumerConfig(
        deliver_policy=DeliverPolicy.BY_START_TIME,
        opt_start_time=start,
        ack_policy=AckPolicy.NONE,
        inactive_threshold=30.0,
    )
    sub = await bus.js.pull_subscribe(subjects.step(watch.job_id), stream=subjects.STEPS.name, config=config)
    fed = 0
    try:
        while True:
            try:
                msgs = await sub.fetch(500, timeout=1.0)
            except (nats.errors.TimeoutError, TimeoutError):
                break
            done = False
            for msg in msgs:
                meta = msg.metadata
                if meta.sequence.stream > upto:
                    done = True
                    break
                try:
                    event = decode(msg.data, subjects.CARRIES["step"])
                except MalformedMessage:
                    continue
                core.on_event(event, event.occurred_at, quiet=True)
                fed += 1
            if done or not msgs or msgs[-1].metadata.num_pending == 0:
                break
    finally:
        with contextlib.suppress(Exception):
            await sub.unsubscribe()
    return fed


async def run(settings: Settings, stop: asyncio.Event) -> None:
    """Connect, restore, consume until `stop`, then drain and close."""
    async with service_connect(settings, "guardian") as conn:
        bus, pool = conn.bus, conn.pool
        notifier = Notifier(settings.webhook_urls)
        service = GuardianService(Guardian(), bus, pool, notifier)
        await restore(service, bus, pool)
        async with asyncio.TaskGroup() as tasks:
            tasks.create_task(bus.consume(LAUNCHES, service.handle, stop))
            tasks.create_task(bus.consume(STATUS, service.handle, stop))
            tasks.create_task(bus.consume(STEPS, service.handle, stop))
            tasks.create_task(bus.consume(GPU, service.handle, stop))
            tasks.create_task(service.hang_loop(stop))
            tasks.create_task(notifier.run(stop))
        log.info(
            "guardian stopped (webhooks: %d delivered, %d failed, %d dropped)",
            notifier.delivered,
            notifier.failed,
            notifier.dropped,
        )
