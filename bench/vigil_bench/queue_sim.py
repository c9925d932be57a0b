"""The simulated cluster of `vigil bench queue`: nodes of 8 GPUs that heartbeat and run what the real
scheduler launches on them, in the bench's own process (the cluster's events are few: a launch, its ranks'
starts and exits, a heartbeat per node every few seconds).

A launched job "runs" for its trace duration, one step every `step_s` seconds: its ranks report started,
and when its steps are done they exit `ok` (the scheduler ends it SUCCEEDED). A `PreemptJob` (a
preemption, or its time limit) is honoured as the worker's spot path does: the job checkpoints at the step
it reached (`CheckpointSaved` from rank 0's node) and its ranks exit `preempted`; relaunched, it resumes
from the launch's `resume_from`, and the steps between that checkpoint and the step it reached are the
steps lost. A node heartbeats again as soon as a job's ranks leave it, so its devices are offered at once.

What happened is kept per job (`Record`): submitted, each attempt's start and end on how many GPUs,
preemptions and the steps they lost.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from vigil.events import (
    CheckpointSaved,
    Device,
    LaunchJob,
    NodeHeartbeat,
    PreemptJob,
    RankExited,
    RankStarted,
    decode,
)
from vigil_bench.queue_trace import TraceJob
from vigil_common import subjects
from vigil_common.bus import Bus

DEVICES = 8
HEARTBEAT_S = 4.0  # the scheduler is told so (VIGIL_HEARTBEAT_INTERVAL_S)
_STEP = re.compile(r"step_(\d+)$")


def job_name(job: TraceJob) -> str:
    return f"q{job.index:05d}"


@dataclass
class Record:
    """One trace job as the cluster saw it; times are seconds on the bench's clock (`Cluster.now`)."""

    job: TraceJob
    steps: int
    submitted: float | None = None
    runs: list[tuple[float, float, int]] = field(default_factory=list)  # (start, end, GPUs) per attempt
    done: int = 0  # steps checkpointed or finished
    reached: int | None = None  # the step the last preemption stopped at
    preemptions: int = 0
    time_limit_stops: int = 0
    steps_lost: int = 0
    finished: float | None = None

    @property
    def first_start(self) -> float | None:
        return self.runs[0][0] if self.runs else None


@dataclass
class _Attempt:
    record: Record
    launch: LaunchJob
    start: float
    resumed: int
    task: asyncio.Task[None] | None = None


class Cluster:
    """`nodes` simulated nodes on `bus`; `records` maps a job's name (`job_name`) to its record."""

    def __init__(
        self, bus: Bus, nodes: int, step_s: float, now: Callable[[], float], prefix: str = "q"
    ) -> None:
        self.bus, self.step_s, self.now = bus, step_s, now
        self.names = [f"{prefix}-{i:03d}" for i in range(nodes)]
        self.busy: dict[str, set[int]] = {n: set() for n in self.names}
        self.records: dict[str, Record] = {}
        self.running: dict[str, _Attempt] = {}  # job id -> its running attempt
        self.finished = asyncio.Event()
        self.errors: list[str] = []
        self._started_at = datetime.now(UTC)
        self._tasks: set[asyncio.Task[None]] = set()
        self._subs: list[Any] = []

    def add(self, job: TraceJob, seconds: float) -> Record:
        """Expect `job`, which runs `seconds` (real) in all."""
        record = Record(job, steps=max(1, round(seconds / self.step_s)))
        self.records[job_name(job)] = record
        return record

    async def start(self) -> None:
        self._subs.append(await self.bus.nc.subscribe(subjects.ALL_LAUNCHES, cb=self._on_launch))
        self._subs.append(await self.bus.nc.subscribe(subjects.ALL_CMDS, cb=self._on_command))
        for name in self.names:
            await self.beat(name)
        self._spawn(self._heartbeats())

    async def stop(self) -> None:
        for sub in self._subs:
            with contextlib.suppress(Exception):
                await sub.unsubscribe()
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    def _spawn(self, coro: Any) -> None:
        task = asyncio.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def beat(self, node: str) -> None:
        beat = NodeHeartbeat(
            node=node,
            address="127.0.0.1",
            devices=[
                Device(index=d, kind="gpu", name="sim-gpu", uuid=f"GPU-{node}-{d}") for d in range(DEVICES)
            ],
            free=[d for d in range(DEVICES) if d not in self.busy[node]],
            interval_s=HEARTBEAT_S,
            started_at=self._started_at,
        )
        await self.bus.publish(subjects.heartbeat(node), beat)

    async def _heartbeats(self) -> None:
        while True:
            await asyncio.sleep(HEARTBEAT_S)  # the heartbeat period
            for node in self.names:
                await self.beat(node)

    # --- a job's attempt ------------------------------------------------------------------------------

    async def _on_launch(self, msg: Any) -> None:
        launch = LaunchJob.model_validate_json(msg.data)
        record = self.records.get(launch.spec.name)
        job_id = str(launch.job_id)
        if record is None or (
            job_id in self.running and self.running[job_id].launch.attempt >= launch.attempt
        ):
            return  # not ours, or a re-publish of the attempt running
        resumed = _step_of(launch.resume_from)
        if record.reached is not None:
            record.steps_lost += max(0, record.reached - resumed)
            record.reached = None
        attempt = _Attempt(record, launch, self.now(), resumed)
        self.running[job_id] = attempt
        for p in launch.placement:
            self.busy[p.node].add(p.device)
        for p in launch.placement:
            started = RankStarted(
                job_id=job_id, attempt=launch.attempt, rank=p.rank, node=p.node, pid=1, log_path="-"
            )
            await self.bus.publish(subjects.status(job_id, p.node), started)
        attempt.task = asyncio.create_task(self._run(attempt))

    async def _run(self, attempt: _Attempt) -> None:
        try:
            await asyncio.sleep((attempt.record.steps - attempt.resumed) * self.step_s)  # the job's work
            await self._end(attempt, attempt.record.steps, "ok", final=True)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # a bench's failure is reported, not hidden
            self.errors.append(f"{attempt.record.job.index}: {exc!r}")

    async def _on_command(self, msg: Any) -> None:
        with contextlib.suppress(ValueError):
            command = decode(msg.data)
            if not isinstance(command, PreemptJob):
                return
            attempt = self.running.get(str(command.job_id))
            if attempt is None or attempt.launch.attempt != command.attempt or attempt.task is None:
                return
            attempt.task.cancel()
            attempt.task = None
            ran = int((self.now() - attempt.start) / self.step_s)
            reached = min(attempt.record.steps - 1, attempt.resumed + ran)
            if command.kind == "preempt":
                attempt.record.preemptions += 1
            else:
                attempt.record.time_limit_stops += 1
            attempt.record.reached = reached
            first = attempt.launch.placement[0].node
            job_id = str(command.job_id)
            saved = CheckpointSaved(
                job_id=job_id, attempt=command.attempt, step=reached,
                path=f"/sim/{job_id}/step_{reached:08d}", bytes=1, manifest_sha256="0" * 64,
                data_position=reached,
            )  # fmt: skip
            await self.bus.publish(subjects.status(job_id, first), saved)
            await self._end(attempt, reached, "preempted", final=command.kind != "preempt")  # a limit ends it

    async def _end(self, attempt: _Attempt, step: int, failure: str, *, final: bool) -> None:
        launch, record = attempt.launch, attempt.record
        job_id = str(launch.job_id)
        end = self.now()
        record.runs.append((attempt.start, end, len(launch.placement)))
        record.done = step
        del self.running[job_id]
        for p in launch.placement:
            exited = RankExited(
                job_id=job_id, attempt=launch.attempt, rank=p.rank, node=p.node, exit_code=0,
                failure=failure, last_step=step,  # type: ignore[arg-type]
            )  # fmt: skip
            await self.bus.publish(subjects.status(job_id, p.node), exited)
            self.busy[p.node].discard(p.device)
        if final:
            record.finished = end
            if all(r.finished is not None for r in self.records.values()):
                self.finished.set()
        for node in {p.node for p in launch.placement}:
            await self.beat(node)


def _step_of(resume_from: str | None) -> int:
    """The step a checkpoint path of ours names; 0 without one."""
    found = _STEP.search(resume_from or "")
    return int(found.group(1)) if found else 0
