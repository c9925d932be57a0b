"""`vigil bench guardian`: from a rank publishing a faulty step to a worker receiving the command.

The guardian runs as its own process (as in production) against real NATS and Postgres. Per
sample, a fresh one-rank job is launched, saves a checkpoint and makes one good step; then
the clock starts, the "rank" publishes a step with a NaN loss (waiting for its publish ack, as
ranks do) and the clock stops when the first command it causes (HaltJob) arrives at a watcher
of the job's cmd subject, the way a rank's command thread watches it (an ordered JetStream
consumer). A core-NATS subscriber's arrival time is reported too.

The floor, measured in the same run and interleaved in rounds: core NATS request/reply
(`vigil_bench.request_reply`, to an echo in another process): the least one can ask of another
process and hear back. `value` is the guardian's p99, `floor` the request/reply p99.
Target: ratio <= 3.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import signal
import statistics
import sys
import time
import uuid

from vigil.events import (
    CheckpointSaved,
    JobStateChanged,
    LaunchJob,
    Message,
    RankPlacement,
    ResumeJob,
    StepCompleted,
)
from vigil.spec import JobSpec
from vigil_bench import measure_on_servers, percentile, request_reply, result, start_service
from vigil_common import subjects
from vigil_common.bus import Bus
from vigil_common.db import create_pool, migrate
from vigil_common.settings import Settings
from vigil_guardian.service import INPUTS

ROUNDS = 5
SAMPLES_PER_ROUND = 100
RR_PER_ROUND = 400

_ECHO = "import sys; from vigil_bench.guardian import echo_main; echo_main(sys.argv[1], sys.argv[2])"


def echo_main(url: str, subject: str) -> None:
    """The floor's other side: answer requests on `subject` with the request, until SIGTERM."""

    async def main() -> None:
        bus = await Bus.connect(url, "bench-echo")
        stop = asyncio.Event()
        asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)

        async def echo(message: Message) -> Message:
            return message

        await request_reply.serve(bus, subject, echo)
        await bus.nc.flush()
        print("ready", flush=True)
        await stop.wait()
        await bus.close()

    asyncio.run(main())


async def _drained(bus: Bus) -> bool:
    """The guardian has judged everything published so far."""
    try:
        infos = [await bus.js.consumer_info(spec.stream.name, spec.durable) for spec in INPUTS]
    except Exception:
        return False
    return not any(info.num_pending or info.num_ack_pending for info in infos)


async def _until(check, timeout_s: float = 30.0) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout_s
    while not await check():
        if time.monotonic() > deadline:
            raise TimeoutError("the guardian did not catch up in time")
        await asyncio.sleep(0.002)  # polling the guardian's consumers


class _Arrivals:
    """When the first command of each job arrived, per kind of subscriber."""

    def __init__(self) -> None:
        self.times: dict[tuple[str, str], float] = {}
        self.changed = asyncio.Event()

    def saw(self, how: str, job: str | None) -> None:
        if job and (how, job) not in self.times:
            self.times[(how, job)] = time.perf_counter()
            self.changed.set()

    async def wait(self, job: str, timeout_s: float = 10.0) -> None:
        deadline = time.monotonic() + timeout_s
        while ("watch", job) not in self.times or ("core", job) not in self.times:
            self.changed.clear()
            await asyncio.wait_for(self.changed.wait(), max(0.001, deadline - time.monotonic()))


async def _sample(bus: Bus, arrivals: _Arrivals, spec: JobSpec, jobs: list[str]) -> tuple[float, float]:
    job = "bench-" + uuid.uuid4().hex[:12]
    jobs.append(job)
    await bus.publish(
        subjects.launch(job),
        LaunchJob(
            job_id=job,
            attempt=1,
            spec=spec,
            master_addr="127.0.0.1",
            master_port=29500,
            placement=[RankPlacement(rank=0, node="bench", device=0, local_rank=0)],
        ),
    )
    await bus.publish(
        subjects.status(job, "bench"),
        CheckpointSaved(
            job_id=job,
            attempt=1,
            step=0,
            path=f"/bench/{job}/step_00000000",
            bytes=1,
            manifest_sha256="x",
            data_position=0,
        ),
    )

    def step(k: int, loss: float) -> StepCompleted:
        return StepCompleted(
            job_id=job,
            attempt=1,
            rank=0,
            node="bench",
            step=k,
            loss=loss,
            local_finite=math.isfinite(loss),
            grad_norm=1.0,
            lr=1e-3,
            tokens=1024,
            tokens_per_s=1e4,
            step_time_s=0.1,
            skipped=math.isnan(loss),
        )

    await bus.publish(subjects.step(job, "bench"), step(0, 3.0))
    await _until(lambda: _drained(bus))
    t0 = time.perf_counter()
    await bus.publish(subjects.step(job, "bench"), step(1, math.nan))
    await arrivals.wait(job)
    # Over: the guardian forgets the job (nobody completes its rollback here; left alone, the
    # guardian would rightly call that a hang a few seconds later, in the middle of other samples).
    await bus.publish(
        subjects.status(job, subjects.CONTROL),
        JobStateChanged(
            job_id=job, attempt=1, from_state="HALTED", to_state="CANCELLED", cause="bench sample over"
        ),
    )
    return arrivals.times[("watch", job)] - t0, arrivals.times[("core", job)] - t0


async def start_guardian(settings: Settings) -> tuple[asyncio.subprocess.Process, dict[str, str]]:
    """The guardian as its own process on the bench's servers (migrated first), and its environment."""
    assert settings.database_url
    pool = await create_pool(settings.database_url)
    await migrate(pool)
    await pool.close()
    return await start_service(settings, "vigil_guardian.main")


async def _measure(settings: Settings) -> dict[str, object]:
    guardian, env = await start_guardian(settings)
    probe = subjects.probe("bench-" + uuid.uuid4().hex[:8])
    echo = await asyncio.create_subprocess_exec(
        sys.executable, "-c", _ECHO, settings.nats_url, probe, env=env, stdout=asyncio.subprocess.PIPE
    )
    bus = await Bus.connect(settings.nats_url, "bench-guardian")
    jobs: list[str] = []
    try:
        await bus.ensure_streams()
        assert echo.stdout is not None
        await asyncio.wait_for(echo.stdout.readline(), 60)  # "ready"
        arrivals = _Arrivals()

        async def on_core(msg) -> None:  # type: ignore[no-untyped-def]
            arrivals.saw("core", subjects.token_at(msg.subject))

        core = await bus.nc.subscribe(subjects.ALL_CMDS, cb=on_core)
        spec = JobSpec(name="bench", resources={"nodes": 1, "gpus_per_node": 1})
        latencies: list[float] = []
        core_latencies: list[float] = []
        rr: list[float] = []
        async with bus.watch(subjects.ALL_CMDS) as commands:

            async def watch() -> None:
                async for command in commands:
                    arrivals.saw("watch", command.job_id)

            watcher = asyncio.create_task(watch())
            await _until(lambda: _drained(bus), 60.0)  # the guardian is up and consuming
            await _sample(bus, arrivals, spec, jobs)  # warm-up, not counted
            for _ in range(ROUNDS):
                for _ in range(SAMPLES_PER_ROUND):
                    w, c = await _sample(bus, arrivals, spec, jobs)
                    latencies.append(w)
                    core_latencies.append(c)
                for _ in range(RR_PER_ROUND):
                    t = time.perf_counter()
                    await request_reply.request(bus, probe, ResumeJob(job_id="bench", reason="ping"))
                    rr.append(time.perf_counter() - t)
            watcher.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await watcher
        await core.unsubscribe()
    finally:
        for proc in (guardian, echo):
            proc.send_signal(signal.SIGTERM)
        for proc in (guardian, echo):
            try:
                await asyncio.wait_for(proc.wait(), 15)
            except TimeoutError:
                proc.kill()
        await bus.close()

    p99, floor = percentile(latencies, 0.99), percentile(rr, 0.99)
    return result(
        "guardian",
        value=p99 * 1e3,
        floor=floor * 1e3,
        unit="ms, p99 faulty step published -> HaltJob received",
        target="ratio <= 3",
        samples=len(latencies),
        p50_ms=round(statistics.median(latencies) * 1e3, 3),
        p99_ms=round(p99 * 1e3, 3),
        core_subscriber_p50_ms=round(statistics.median(core_latencies) * 1e3, 3),
        core_subscriber_p99_ms=round(percentile(core_latencies, 0.99) * 1e3, 3),
        request_reply_p50_ms=round(statistics.median(rr) * 1e3, 3),
        request_reply_p99_ms=round(floor * 1e3, 3),
        request_reply_n=len(rr),
    )


async def run(settings: Settings) -> dict[str, object]:
    return await measure_on_servers(_measure, settings)
