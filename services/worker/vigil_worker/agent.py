"""The worker agent: one per node. Registers the node's devices, heartbeats, samples them, turns launch
events for this node into running ranks (through `launch`), reports rank starts and exits, and ends
ranks on cancel or when one of their siblings dies. On a preemption notice (SIGTERM, with
VIGIL_PREEMPT_ON_SIGTERM, or the cloud's notice file) it offers no device any more, tells its ranks
(SIGUSR1: they write the emergency checkpoint at the next step boundary and exit `preempted`), and
ends what is left when the grace period is over.

Rank state lives in the `RankTable` on disk, so a restarted agent finds the ranks a previous one
started (`recover`) and reports the truth about each.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import time
from datetime import UTC, datetime
from pathlib import Path

from vigil.errors import SpecError
from vigil.events import (
    CancelJob,
    DeviceDiagnosed,
    DiagnoseDevice,
    DumpStacks,
    FailureType,
    LaunchJob,
    Message,
    NodeHeartbeat,
    RankExited,
    RankStarted,
    StacksDumped,
)
from vigil.exits import EXIT_PREEMPTED, EXIT_SPEC
from vigil.preemption import SIGNAL as PREEMPTION_SIGNAL
from vigil_common import subjects
from vigil_common.bus import Bus, Delivery
from vigil_common.service import wait_any
from vigil_common.settings import Settings
from vigil_common.stack_frames import waits_in_collective
from vigil_worker import code_pack, exit_report, parked, tenancy, workdirs
from vigil_worker.diagnose import Outcome, check_device
from vigil_worker.inventory import Inventory
from vigil_worker.launch import prepare_ranks, warm_argv
from vigil_worker.procs import Exit, RankRecord, RankToStart
from vigil_worker.runtime import Runtime
from vigil_worker.stacks import dump, fit
from vigil_worker.tenancy import Tenancy
from vigil_worker.warm import WarmRanks

log = logging.getLogger("vigil.worker")

KILL_GRACE_S = 5.0  # SIGTERM, then SIGKILL after this long
MONITOR_INTERVAL_S = 0.2
NOTICE_POLL_S = 1.0  # how often the preemption notice file is looked for


class Worker:
    def __init__(self, settings: Settings, bus: Bus, inventory: Inventory, runtime: Runtime) -> None:
        self.settings = settings
        self.bus = bus
        self.inventory = inventory
        self.node = settings.node_name
        self.table, self.relay, self.pods = runtime.table, runtime.relay, runtime.pods  # processes, or pods
        self.tenancy = Tenancy(settings)  # each job's user and cgroup here
        self.warm: WarmRanks | None = None  # built-in trainer ranks kept warm (`start_warm`)
        self.started_at = datetime.now(UTC)
        self._ending: dict[int, float] = {}  # pid -> when SIGTERM was sent
        self.preempting = False  # a preemption notice came: no new ranks here
        self._checks: dict[str, asyncio.Task[None]] = {}  # DiagnoseDevice event id -> its running check
        self._dumps: dict[str, asyncio.Task[None]] = {}  # DumpStacks event id -> its dump
        self._waiting: dict[str, tuple[int, dict[int, bool]]] = {}  # job -> attempt, rank in a collective

    # --- startup: the truth about ranks a previous run started ---------------------------------------------

    async def recover(self) -> None:
        self.tenancy.prepare_node()
        self.table.load()
        for r in self.table.running():
            self.tenancy.adopt(r.job_id, r.uid)
            if r.alive():
                log.info(
                    "found rank %d of %s (attempt %d) still running as pid %d",
                    r.rank,
                    r.job_id,
                    r.attempt,
                    r.pid,
                )
            # ranks that ended while no worker watched are reported by the monitor's first pass
        if swept := self.tenancy.sweep_snapshots({r.job_id for r in self.table.running()}):
            log.info("removed the in-memory snapshots of %d job(s) with no rank here", len(swept))
        await self.monitor_once()

    # --- launches ------------------------------------------------------------------------------------------

    async def on_launch(self, launch: Message, delivery: Delivery) -> None:
        assert isinstance(launch, LaunchJob) and launch.job_id is not None
        job = launch.job_id
        if not any(p.node == self.node for p in launch.placement):
            return
        if self.table.attempts.get(job, 0) >= launch.attempt:
            log.info("ignoring launch of %s attempt %d: already run here", job, launch.attempt)
            return
        if self.preempting:  # placed here before our empty heartbeat arrived: send it elsewhere
            for p in launch.placement:
                if p.node == self.node:
                    await self._publish_exit_without_start(
                        launch, p.rank, f"node {self.node} is being preempted", failure="preempted"
                    )
            return
        await self.monitor_once()  # a survivor that parked since the last look is taken too
        hung = parked.hung(self.table, launch, self.settings, self._waiting.pop(job, None))
        await self.end_ranks(hung)  # a hang's hung ranks first; the others are told (off the loop) and park
        if waiting := await asyncio.to_thread(parked.cut_all, self.table, launch, self.node, self.settings):
            await self._until_parked(waiting, parked.PARK_WINDOW_S)
        takers = parked.takers(self.table, launch, self.node)  # survivors parked in their processes
        handed: set[int] = set()
        older = [r for r in self.table.running(job) if r not in takers.values()]
        if older:  # a newer attempt replaces the old ranks
            log.warning(
                "%s attempt %d supersedes attempt %d: ending its ranks", job, launch.attempt, older[0].attempt
            )
        await self.end_ranks(older + parked.in_the_way(self.table, launch, self.node))
        self.table.attempts[job] = launch.attempt
        self.table.save()  # before starting: a crash now must not start this attempt twice

        devices = {d.index for d in self.inventory.devices}
        user = self.tenancy.user_for(job)
        try:
            await code_pack.unpack(self.bus, self.settings, launch)  # its code package, if it has one
            ranks = prepare_ranks(launch, self.settings, self.inventory.kind, self.relay.socket_path, user)
            ranks = workdirs.for_ranks(ranks, self.settings, launch, user)  # a code root's: writable view
        except (SpecError, code_pack.Unavailable) as exc:  # the program may not run here: nothing runs
            spec = isinstance(exc, SpecError)  # for good: the job fails; a pack not right: this attempt
            if not self.table.running(job):
                self.tenancy.release(job)
            for p in launch.placement:
                if p.node == self.node:
                    await self._publish_exit_without_start(
                        launch, p.rank, str(exc), "spec" if spec else "error", EXIT_SPEC if spec else None
                    )
            return
        if user is not None:
            self.tenancy.give_to(user, self.settings, job, launch.attempt)
        else:
            self.tenancy.own_snapshots(job)
        group = self.tenancy.cgroup(launch)
        enter = tenancy.enter(user, group)
        for r in ranks:
            p = r.placement
            if p.device not in devices:
                await self._publish_exit_without_start(
                    launch, p.rank, f"device {p.device} is not on node {self.node}"
                )
                continue
            who = RankToStart(
                job_id=job,
                attempt=launch.attempt,
                rank=p.rank,
                device=p.device,
                log_path=r.log_path,
                exit_path=r.exit_path,
                token=r.token,
                uid=None if user is None else user.uid,
                world_size=launch.world_size,
                builtin=launch.spec.entrypoint is None,
            )
            if p.rank in takers and (
                kept := parked.hand_over(self.table, takers[p.rank], r, who, user, group)
            ):
                handed.add(takers.pop(p.rank).attempt)
                log.info(
                    "rank %d of %s attempt %d goes on in its own process (pid %d), parked since it failed",
                    p.rank, job, launch.attempt, kept.pid,
                )  # fmt: skip
                await self._rank_started(launch, p.rank, kept.pid, r.log_path)
                continue
            standby = self.warm.take(p.device) if self.warm is not None and warm_argv(r.argv) else None
            if standby is not None:
                self.table.clear(r.log_path, r.exit_path)
                try:
                    standby.hand(r, user, group)
                except OSError as exc:  # it died since it was ready: start the rank as usual
                    log.warning("a warm rank could not take rank %d of %s: %s", p.rank, job, exc)
                    standby.proc.kill()
                    standby = None
            if standby is not None:
                record = self.table.adopt(standby.proc, who)
            else:
                record = self.table.start(who, r.argv, r.env, cwd=r.cwd, enter=enter)
            log.info(
                "started rank %d of %s attempt %d on device %d: pid %d, uid %s%s",
                p.rank, job, launch.attempt, p.device, record.pid,
                "the worker's" if user is None else user.uid, " (warm)" if standby is not None else "",
            )  # fmt: skip
            await self._rank_started(launch, p.rank, record.pid, r.log_path)
        if takers:  # parked ranks the launch did not take after all (their hand-over failed)
            await self.end_ranks(list(takers.values()))
        for attempt in sorted(handed):  # the attempts the parked ranks left: their cgroups go
            await self._settle(job, attempt)

    async def _rank_started(self, launch: LaunchJob, rank: int, pid: int, log_path: Path) -> None:
        assert launch.job_id is not None
        await self.bus.publish(
            subjects.status(launch.job_id, self.node),
            RankStarted(
                job_id=launch.job_id,
                attempt=launch.attempt,
                rank=rank,
                node=self.node,
                pid=pid,
                log_path=str(log_path),
            ),
        )

    async def _publish_exit_without_start(
        self,
        launch: LaunchJob,
        rank: int,
        why: str,
        failure: FailureType = "error",
        exit_code: int | None = None,
    ) -> None:
        log.error("%s rank %d: %s", launch.job_id, rank, why)
        await self.bus.publish(
            subjects.status(str(launch.job_id), self.node),
            RankExited(
                job_id=launch.job_id,
                attempt=launch.attempt,
                rank=rank,
                node=self.node,
                exit_code=exit_code,
                failure=failure,
                log_tail=why,
            ),
        )

    # --- commands ------------------------------------------------------------------------------------------

    async def on_command(self, command: Message, delivery: Delivery) -> None:
        """The agent's own command is cancel. Halt, rollback and resume are the ranks' (the relay feeds them
        their job's); a restart reaches this agent as the next attempt's LaunchJob."""
        match command:
            case CancelJob(job_id=str(job)) if ranks := self.table.running(job):
                log.warning("cancelling %s: %s", job, command.reason or "no reason given")
                await self.end_ranks(ranks)
                self.tenancy.forget_snapshots(job)  # no attempt follows a cancel: its memory goes back
            case DiagnoseDevice(node=node) if node == self.node and command.event_id not in self._checks:
                # in the background: a cancel must not wait for it. One lost with this agent is no mark.
                task = asyncio.create_task(self.diagnose(command), name=f"diagnose-{command.device}")
                self._checks[command.event_id] = task
                while len(self._checks) > 1000:  # remembered for redeliveries, within bounds
                    self._checks.pop(next(iter(self._checks)))
            case DumpStacks(job_id=str(job)) if command.event_id not in self._dumps and (
                ranks := [r for r in self.table.running(job) if r.attempt == command.attempt]
            ):
                # in the background, as a check: the consumer goes on to the halt or cancel that follows
                task = asyncio.create_task(self.dump_stacks(command, ranks), name=f"stacks-{job}")
                self._dumps[command.event_id] = task
                while len(self._dumps) > 1000:
                    self._dumps.pop(next(iter(self._dumps)))
            case _:
                pass

    async def dump_stacks(self, command: DumpStacks, ranks: list[RankRecord]) -> None:
        """Read the Python stacks of this node's ranks of the hung job (py-spy, all threads, in parallel)
        and report them (`StacksDumped`) within the command's bound."""
        started = time.monotonic()
        bound = max(0.2, command.within_s * 0.75)  # the rest of the guardian's wait is the trip back
        dumps = await asyncio.gather(*(dump(r.rank, r.pid, r.exit_path, bound) for r in ranks))
        took = time.monotonic() - started
        self._waiting[str(command.job_id)] = (
            command.attempt,
            {d.rank: waits_in_collective(d) for d in dumps},
        )
        failed = [d.rank for d in dumps if d.error]
        log.warning("%s: dumped the stacks of ranks %s in %.2fs%s", command.job_id, [r.rank for r in ranks],
                    took, f" (not: {failed})" if failed else "")  # fmt: skip
        try:
            await self.bus.publish(
                subjects.status(str(command.job_id), self.node),
                StacksDumped(
                    event_id=f"{command.event_id}-{self.node}"[:128],
                    job_id=command.job_id,
                    attempt=command.attempt,
                    node=self.node,
                    command_id=command.event_id,
                    ranks=fit(sorted(dumps, key=lambda d: d.rank)),
                    duration_s=took,
                ),
            )
        except Exception as exc:  # the guardian's wait ends without them: its incident says so
            log.warning("%s: the stacks were not reported: %s", command.job_id, exc)

    async def diagnose(self, command: DiagnoseDevice) -> None:
        """Run the known-answer check on one of this node's devices and report it (`DeviceDiagnosed`)."""
        if command.device in {d.index for d in self.inventory.devices}:
            log.warning("checking device %d: %s", command.device, command.reason)
            o = await check_device(self.inventory.kind, command.device, self.settings.diagnose_timeout_s)
        else:
            o = Outcome(None, error=f"no device {command.device} on node {self.node}")
        said = {True: "passed", False: "FAILED", None: "inconclusive"}[o.passed]
        log.log(logging.INFO if o.passed else logging.WARNING, "device %d check %s: %s", command.device,
                said, o.error or o.checks)  # fmt: skip
        try:
            await self.bus.publish(
                subjects.status(str(command.job_id), self.node),
                DeviceDiagnosed(
                    event_id=f"{command.event_id}-diagnosed",
                    job_id=command.job_id,
                    attempt=command.attempt,
                    node=self.node,
                    device=command.device,
                    passed=o.passed,
                    checks=o.checks,
                    error=o.error,
                    duration_s=o.duration_s,
                    command_id=command.event_id,
                ),
            )
        except Exception as exc:  # a check not reported marks nothing: the device stays offered
            log.warning("the check of device %d was not reported: %s", command.device, exc)

    async def end_ranks(self, ranks: list[RankRecord]) -> None:
        """SIGTERM, SIGKILL after the grace period; returns once every one has exited and been reported."""
        for r in ranks:
            self.table.terminate(r)
            self._ending.setdefault(r.pid, time.monotonic())
        while any(not r.reported for r in ranks):
            await self.monitor_once()
            if any(not r.reported for r in ranks):
                await asyncio.sleep(MONITOR_INTERVAL_S)  # polling the processes, not synchronisation

    async def _until_parked(self, ranks: list[RankRecord], within_s: float) -> None:
        """Until each of `ranks` has parked or exited, for `within_s` at most."""
        deadline = time.monotonic() + within_s
        while time.monotonic() < deadline:
            await self.monitor_once()
            if all(r.parked_at is not None or r.reported for r in ranks):
                return
            await asyncio.sleep(MONITOR_INTERVAL_S)  # polling the processes, not synchronisation

    # --- the monitor ----------------------------------------------------------------------------------------

    async def monitor_once(self) -> None:
        now = time.monotonic()
        for r in list(self.table.running()):
            ended = self.table.poll(r)
            if ended is None:
                if (why := parked.newly_parked(r)) is not None:
                    await self._report_parked(r, why)
                elif parked.waited_too_long(r) and not r.killed:
                    log.warning("rank %d of %s: parked for %.0fs, no attempt took it", r.rank, r.job_id,
                                parked.PARKED_FOR_S)  # fmt: skip
                    self.table.terminate(r)
                    self._ending.setdefault(r.pid, now)
                since = self._ending.get(r.pid)
                if r.killed and since is not None and now - since > KILL_GRACE_S:
                    self.table.signal(r, signal.SIGKILL)
                continue
            await self._report_exit(r, ended)
            if not r.killed and r.parked_at is None and ended.code not in (0, EXIT_PREEMPTED):
                # one rank died: take its siblings here down too (they would block in a collective),
                # but for those that park when their collective fails (they wait for the next attempt)
                siblings = [
                    s
                    for s in self.table.running(r.job_id)
                    if s.attempt == r.attempt and not s.killed and not parked.parks(s, self.settings)
                ]
                for s in siblings:
                    log.warning("rank %d of %s died: ending rank %d", r.rank, r.job_id, s.rank)
                    self.table.terminate(s)
                    self._ending.setdefault(s.pid, now)

    async def _report_parked(self, r: RankRecord, why: str) -> None:
        """A rank parked (`parked`): to the control plane it exited; its process waits here. Noted once
        the event is stored (a failed publish is tried again on the monitor's next look)."""
        await self.bus.publish(subjects.status(r.job_id, self.node), exit_report.rank_parked(r, self.node))
        r.parked_at = time.time()
        self.table.save()
        log.warning("rank %d of %s attempt %d parked in its process: %s", r.rank, r.job_id, r.attempt,
                    why.splitlines()[-1][:300])  # fmt: skip

    async def _report_exit(self, r: RankRecord, ended: Exit) -> None:
        if r.parked_at is not None:  # its RankExited went out as it parked: its process ended since
            log.info("rank %d of %s attempt %d, parked, ended", r.rank, r.job_id, r.attempt)
            self._ending.pop(r.pid, None)
            self.table.mark_reported(r)
            await self._settle(r.job_id, r.attempt)
            return
        failure = exit_report.failure_of(r, ended)
        log.log(
            logging.INFO if failure in ("ok", "killed_by_vigil", "preempted") else logging.WARNING,
            "rank %d of %s attempt %d exited: code %s signal %s (%s)",
            r.rank,
            r.job_id,
            r.attempt,
            ended.code,
            ended.signal,
            failure,
        )
        event = exit_report.rank_exited(r, self.node, ended, failure)
        await self.bus.publish(subjects.status(r.job_id, self.node), event)
        self._ending.pop(r.pid, None)
        self.table.mark_reported(r)
        if self.warm is not None:
            self.warm.ranks_ended()  # a CPU node's warm ranks are replaced once its ranks are done
        await self._settle(r.job_id, r.attempt)

    async def _settle(self, job_id: str, attempt: int) -> None:
        """Once an attempt has no rank left here, its cgroup is killed (a forked child that outlived its rank
        with it) and removed, its overlay unmounted; once the job has none, its user's processes end, its uid
        goes back."""
        if any(r.attempt == attempt for r in self.table.running(job_id)):
            return
        await self.tenancy.end_cgroup(job_id, attempt)
        workdirs.release(self.settings, job_id, attempt)
        if not self.table.running(job_id):  # checked again after the wait: a next attempt may have begun
            self.tenancy.release(job_id)

    async def monitor_loop(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            try:
                await self.monitor_once()
            except Exception:
                log.exception("rank monitor pass failed; trying again")
            await wait_any(stop, timeout_s=MONITOR_INTERVAL_S)

    # --- preemption ---------------------------------------------------------------------------------------

    async def preemption_loop(self, notice: asyncio.Event, stop: asyncio.Event) -> None:
        """Wait for a preemption notice (`notice` set by SIGTERM, or the notice file appearing), preempt,
        then stop the worker: the node is going away."""
        path = self.settings.preemption_notice_file
        while not stop.is_set():
            if notice.is_set():
                why = "SIGTERM"
            elif path is not None and path.exists():
                why = f"notice file {path}"
            else:
                await wait_any(stop, notice, timeout_s=NOTICE_POLL_S)
                continue
            await self.preempt(why)
            stop.set()
            return

    async def preempt(self, why: str) -> None:
        """Offer no device, tell every rank here to checkpoint and exit, and end the ones still running
        when the grace period is over. Returns once every rank has been reported."""
        self.preempting = True
        ranks = [r for r in self.table.running() if not r.killed]
        grace = self.settings.preemption_grace_s
        log.warning("preemption notice (%s): %d rank(s) checkpoint within %.0fs", why, len(ranks), grace)
        await self.bus.publish(subjects.heartbeat(self.node), self.heartbeat())  # no free device now
        for r in ranks:
            self.table.notify(r, PREEMPTION_SIGNAL)
        deadline = time.monotonic() + grace
        while any(not r.reported for r in ranks) and time.monotonic() < deadline:
            await self.monitor_once()  # as in end_ranks: report each exit as it happens
            if any(not r.reported for r in ranks):
                await asyncio.sleep(MONITOR_INTERVAL_S)  # polling the processes, not synchronisation
        if late := [r for r in ranks if not r.reported]:
            log.error("%d rank(s) did not exit within the grace period: ending them", len(late))
            await self.end_ranks(late)

    # --- heartbeats and samples ---------------------------------------------------------------------------

    def heartbeat(self) -> NodeHeartbeat:
        busy = {r.device for r in self.table.running() if r.parked_at is None}  # a parked rank lets go
        return NodeHeartbeat(
            node=self.node,
            address=self.settings.node_address,
            devices=self.inventory.devices,
            free=[] if self.preempting else [d.index for d in self.inventory.devices if d.index not in busy],
            interval_s=self.settings.heartbeat_interval_s,
            started_at=self.started_at,
        )

    async def heartbeat_loop(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            try:
                await self.bus.publish(subjects.heartbeat(self.node), self.heartbeat())
            except Exception as exc:
                log.warning("heartbeat not published: %s", exc)
            await wait_any(stop, timeout_s=self.settings.heartbeat_interval_s)

    async def sample_loop(self, stop: asyncio.Event) -> None:
        def rank_on(index: int) -> tuple[int, str, int] | None:
            r = self.table.on_device(index)
            return (r.pid, r.job_id, r.attempt) if r else None

        while not stop.is_set():
            try:
                samples = await asyncio.to_thread(self.inventory.sample, self.node, rank_on)
                for s in samples:
                    await self.bus.publish(subjects.gpu(self.node), s)
            except Exception as exc:
                log.warning("device samples not published: %s", exc)
            await wait_any(stop, timeout_s=self.settings.gpu_sample_interval_s)
