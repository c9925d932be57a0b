"""Every job and device the guardian watches: events in, decisions out (pure; no I/O)."""

from __future__ import annotations

import dataclasses
from collections import OrderedDict
from collections.abc import Iterable
from datetime import datetime

from vigil.events import DumpStacks, GpuSampled, GuardianInput, LaunchJob, StepCompleted
from vigil_guardian.devices import Devices
from vigil_guardian.gpu_health import GpuLimits
from vigil_guardian.policy import Decision, Policy, incident_id
from vigil_guardian.verdict import Verdict
from vigil_guardian.watch import JobWatch

FINISHED_MAX = 10_000
KNOWN_MAX = 100_000


class Guardian:
    """The decision core of the guardian service."""

    def __init__(
        self, limits: GpuLimits | None = None, *, idle_devices: bool = True, devices: Devices | None = None
    ) -> None:
        self.limits = limits or GpuLimits()
        # Judge a sick device that runs none of this core's jobs (a guardian's share 0 does; the others
        # leave it to that one: the device may run a job of another share).
        self.idle_devices = idle_devices
        self.jobs: dict[str, JobWatch] = {}
        self.finished: OrderedDict[str, None] = OrderedDict()
        # The devices' health: this core's own, or its guardian's, shared by the shares it holds (the
        # guardian then calls `judge_device` with each verdict, see `vigil_guardian.devices`).
        self.devices = devices if devices is not None else Devices(self.limits)
        self.published: OrderedDict[str, None] = OrderedDict()  # incident ids already out

    def job(self, job_id: str) -> JobWatch | None:
        if job_id in self.finished:
            return None
        if job_id not in self.jobs:
            self.jobs[job_id] = JobWatch(job_id)
        return self.jobs[job_id]

    def on_event(self, event: GuardianInput, now: datetime, *, quiet: bool = False) -> list[Decision]:
        """Feed one event; returns the decisions to publish (none already published)."""
        if isinstance(event, GpuSampled):  # a device's, not a job's
            verdict = self.devices.observe(event)
            return self.judge_device(event, verdict, now) if verdict is not None else []
        if event.job_id is None or (watch := self.job(event.job_id)) is None:
            return []
        out: list[Decision] = []
        match event:
            case StepCompleted():
                out = watch.on_step(event, now, quiet=quiet)
            case LaunchJob():
                watch.on_launch(event)
            case _:
                out = watch.on_status(event, now)  # the rest of the union: StatusEvent
        if watch.control.terminal:
            self.finish(event.job_id)
        return self._fresh(out)

    def hang_candidates(self, now: datetime) -> list[str]:
        """The jobs `check_hangs` would decide about now (nothing changes)."""
        return [job_id for job_id, watch in self.jobs.items() if watch.hang_verdict(now) is not None]

    def ask_stacks(self, now: datetime, job_ids: Iterable[str], within_s: float) -> list[DumpStacks]:
        """The `DumpStacks` commands to send first for the hangs of `job_ids` (see `JobWatch.ask_stacks`)."""
        out = []
        for job_id in job_ids:
            if (watch := self.jobs.get(job_id)) is not None and (
                command := watch.ask_stacks(now, within_s)
            ) is not None:
                out.append(command)
        return out

    def check_hangs(self, now: datetime, job_ids: Iterable[str] | None = None) -> list[Decision]:
        """Hang decisions for every job (or those of `job_ids`)."""
        out: list[Decision] = []
        for job_id in list(self.jobs) if job_ids is None else list(job_ids):
            if (watch := self.jobs.get(job_id)) is not None:
                out += watch.check_hang(now)
        return self._fresh(out)

    def finish(self, job_id: str) -> None:
        self.jobs.pop(job_id, None)
        self.finished[job_id] = None
        while len(self.finished) > FINISHED_MAX:
            self.finished.popitem(last=False)

    def mark_published(self, iid: str) -> None:
        self.published[iid] = None
        while len(self.published) > KNOWN_MAX:
            self.published.popitem(last=False)

    def _fresh(self, decisions: list[Decision]) -> list[Decision]:
        return [d for d in decisions if d.incident.event_id not in self.published]

    # --- devices ------------------------------------------------------------------------------------

    def device_job(self, node: str, index: int) -> tuple[JobWatch, int] | None:
        """The job (and rank) running on a device, from the launches seen."""
        for watch in self.jobs.values():
            for rank, (n, d) in watch.control.placement.items():
                if (n, d) == (node, index) and rank not in watch.control.exited:
                    return watch, rank
        return None

    def judge_device(self, sample: GpuSampled, verdict: Verdict, now: datetime) -> list[Decision]:
        """Decide about a device's verdict (from the sample that made it): the job's on it, or, with
        `idle_devices`, the device's alone."""
        return self._fresh(self._decide_device(sample, verdict, now))

    def _decide_device(self, sample: GpuSampled, verdict: Verdict, now: datetime) -> list[Decision]:
        found = self.device_job(sample.node, sample.index)
        if found is not None:
            watch, rank = found
            verdict = dataclasses.replace(verdict, rank=rank)
            last = [p[1] for p in watch.windows.progress.values() if p[1] is not None]
            anomaly = min(last) + 1 if last else None
            return [watch.decide(verdict, now, anomaly_step=anomaly, key=sample.event_id)]
        if not self.idle_devices:
            return []
        iid = incident_id(None, sample.node, sample.index, "gpu_health", sample.event_id)
        return [
            Policy().decide(verdict, iid=iid, job_id=None, attempt=0, checkpoints={}, rollbacks=0, now=now)
        ]

    def device_levels(self) -> dict[tuple[str, int], int]:
        return self.devices.levels()

    def restore_devices(self, levels: dict[tuple[str, int], int]) -> None:
        self.devices.restore(levels)
