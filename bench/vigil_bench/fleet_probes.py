"""`vigil bench fleet`'s view of the guardians and the consumers: the detect-to-command probes (a probe
job's NaN step published -> its HaltJob received) and where each durable consumer stands."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import statistics
import time
import uuid
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import nats.errors
import nats.js.errors
from nats.js.api import ConsumerInfo

from vigil.errors import RetryableError
from vigil.events import CheckpointSaved, JobStateChanged, LaunchJob, RankPlacement, StepCompleted
from vigil.spec import JobSpec
from vigil_bench import percentile
from vigil_common import credentials, lease, subjects
from vigil_common.bus import Bus
from vigil_guardian.service import job_input, last_stored

log = logging.getLogger(__name__)


class Halts:
    """When the first HaltJob of each probe job arrived (a core subscriber of every cmd subject)."""

    def __init__(self) -> None:
        self.at: dict[str, float] = {}
        self.changed = asyncio.Event()

    async def on_msg(self, msg: Any) -> None:
        job = subjects.token_at(msg.subject)
        if job.startswith("probe-") and job not in self.at:
            self.at[job] = time.perf_counter()
            self.changed.set()

    async def wait(self, job: str, timeout_s: float) -> float | None:
        deadline = time.monotonic() + timeout_s
        while job not in self.at:
            self.changed.clear()
            try:
                await asyncio.wait_for(self.changed.wait(), max(0.001, deadline - time.monotonic()))
            except TimeoutError:
                return None
        return self.at[job]


async def consumer_idle(bus: Bus, stream: str, durable: str) -> bool:
    try:
        info = await bus.js.consumer_info(stream, durable)
    except Exception:
        return False
    return not (info.num_pending or info.num_ack_pending)


def steps_stream() -> str:
    return subjects.stream_for(subjects.ALL_STEPS).name


async def durables(bus: Bus, streams: Iterable[str] | None = None) -> list[ConsumerInfo]:
    """Every durable consumer on `streams` (all of them unless told)."""
    found = []
    for stream in streams if streams is not None else [spec.name for spec in subjects.STREAMS]:
        with contextlib.suppress(nats.js.errors.NotFoundError):
            found += [c for c in await bus.js.consumers_info(stream) if c.config.durable_name]
    return found


def backlog(info: ConsumerInfo) -> int:
    return (info.num_pending or 0) + (info.num_ack_pending or 0)


async def guardian_idle(bus: Bus) -> bool:
    """Every share's consumer exists and is caught up."""
    mine = {c.name: c for c in await durables(bus, [subjects.JOBS.name])}
    inputs = [credentials.guardian_input(k) for k in range(subjects.SHARES)]
    return all(name in mine and not backlog(mine[name]) for name in inputs)


async def guardians_divided(pool: Any, n: int) -> bool:
    """`n` guardians hold all the shares, each its fair part."""
    held = [h.shares for h in await lease.holders(pool) if h.role == "guardian"]
    fair = math.ceil(subjects.SHARES / n)
    return len(held) == n and sum(map(len, held)) == subjects.SHARES and all(len(s) <= fair for s in held)


async def guardian_has(bus: Bus, job: str) -> bool:
    """The consumer of the job's share has acknowledged every event published of the job so far."""
    seq = await last_stored(bus, job)
    if seq is None:
        return False  # not stored yet
    spec = job_input(job)
    info = await bus.js.consumer_info(spec.stream.name, spec.durable)
    return (info.ack_floor.stream_seq if info.ack_floor else 0) >= seq


async def judged_by_guardian(pool: Any, bus: Bus) -> dict[str, tuple[int, int]]:
    """Per guardian (pid@host): the messages its shares' consumers have acknowledged, and the messages
    those consumers were offered (delivered or still pending). Jobs fall into shares by a hash of their
    random ids, so a guardian whose shares hold no running job is offered nothing and judges nothing."""
    infos = await durables(bus, [subjects.JOBS.name])
    acked = {c.name: c.ack_floor.consumer_seq if c.ack_floor else 0 for c in infos}
    offered = {c.name: (c.delivered.consumer_seq if c.delivered else 0) + (c.num_pending or 0) for c in infos}
    out: dict[str, tuple[int, int]] = {}
    for h in await lease.holders(pool):
        if h.role == "guardian":
            names = [credentials.guardian_input(k) for k in h.shares]
            out[h.instance] = (sum(acked.get(n, 0) for n in names), sum(offered.get(n, 0) for n in names))
    return out


@dataclass
class Stages:
    """Where a probe's time went: the NaN step's publish until VIGIL_JOBS acknowledged it (`stored`: the
    store's own latency, an fsync per message; seconds when the stream cannot keep up with the fleet);
    and, from the server's store times, the NaN step stored in VIGIL_JOBS (under its share) -> the
    guardian's HaltJob stored in VIGIL_COMMANDS (`judge`: delivery, judging, publishing)."""

    stored: list[float] = field(default_factory=list)
    judge: list[float] = field(default_factory=list)

    async def add(self, bus: Bus, job: str) -> None:
        with contextlib.suppress(nats.errors.Error, nats.js.errors.Error):
            step = subjects.step(job, "probe")
            stored = await bus.last_stored(subjects.JOBS.name, step)
            halted = await bus.js.get_last_msg(subjects.COMMANDS.name, subjects.cmd(job))
            raw = await bus.js.get_msg(subjects.JOBS.name, stored.seq) if stored is not None else None
            if raw is not None and raw.time and halted.time:
                self.judge.append((halted.time - raw.time).total_seconds())

    def summary(self) -> dict[str, float | None]:
        out: dict[str, float | None] = {}
        for name, values in (("stored", self.stored), ("judge", self.judge)):
            out[f"{name}_p50_ms"] = round(statistics.median(values) * 1e3, 2) if values else None
            out[f"{name}_p99_ms"] = round(percentile(values, 0.99) * 1e3, 2) if values else None
        return out


async def probe(
    bus: Bus, halts: Halts, spec: JobSpec, stages: Stages, timeout_s: float = 30.0
) -> float | None:
    """Seconds from a probe job's NaN step to its HaltJob; None when none came within `timeout_s`, or
    when the store did not acknowledge one of its publishes (a stream that cannot keep up: a missed
    probe, not the end of the run)."""
    try:
        return await _probe(bus, halts, spec, stages, timeout_s)
    except (RetryableError, nats.errors.Error) as exc:
        log.warning("fleet bench: a probe missed: %s", exc)
        return None


async def _probe(bus: Bus, halts: Halts, spec: JobSpec, stages: Stages, timeout_s: float) -> float | None:
    job = "probe-" + uuid.uuid4().hex[:12]
    placement = [RankPlacement(rank=0, node="probe", device=0, local_rank=0)]
    await bus.publish(
        subjects.launch(job),
        LaunchJob(
            job_id=job, attempt=1, spec=spec, master_addr="127.0.0.1", master_port=29500, placement=placement
        ),
    )
    await bus.publish(
        subjects.status(job, "probe"),
        CheckpointSaved(job_id=job, attempt=1, step=0, path=f"/probe/{job}/step_00000000", bytes=1,
                        manifest_sha256="x", data_position=0),
    )  # fmt: skip
    # the guardian knows the job (its launch and checkpoint acknowledged) before its steps come
    deadline = time.monotonic() + timeout_s
    while not await guardian_has(bus, job):
        if time.monotonic() > deadline:
            return None
        await asyncio.sleep(0.01)  # polling the guardian's consumers

    def step(k: int, loss: float) -> StepCompleted:
        return StepCompleted(
            job_id=job, attempt=1, rank=0, node="probe", step=k, loss=loss, local_finite=math.isfinite(loss),
            grad_norm=1.0, lr=1e-3, tokens=1024, tokens_per_s=1e4, step_time_s=0.1, skipped=math.isnan(loss),
        )  # fmt: skip

    await bus.publish(subjects.step(job, "probe"), step(0, 3.0))
    t0 = time.perf_counter()
    await bus.publish(subjects.step(job, "probe"), step(1, math.nan))
    stages.stored.append(time.perf_counter() - t0)
    arrived = await halts.wait(job, timeout_s)
    if arrived is not None:
        await stages.add(bus, job)
    await bus.publish(
        subjects.status(job, subjects.CONTROL),
        JobStateChanged(job_id=job, attempt=1, from_state="HALTED", to_state="CANCELLED", cause="probe over"),
    )
    return None if arrived is None else arrived - t0
