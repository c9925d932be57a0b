"""The simulated nodes of `vigil bench fleet`: a process of its own that publishes for a range of nodes.

Each node heartbeats with 8 devices, samples every device every few seconds, and once the scheduler
has placed a job on it (one 8-device job per node) reports its ranks started and publishes one step
event per rank at the step rate, each node at its own phase of the step period. Events go out on core
NATS with `Nats-Msg-Id` (the streams store them as they store any publish): the generator's own
acknowledgement waits are not the system's cost.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import signal
from dataclasses import dataclass
from typing import Any

import nats

from vigil.events import Device, GpuSampled, LaunchJob, NodeHeartbeat, RankStarted, StepCompleted, utcnow
from vigil_bench import percentile
from vigil_common import subjects

DEVICES = 8
HEARTBEAT_S = 2.0
GPU_SAMPLE_S = 5.0


def node_name(i: int) -> str:
    return f"sim-{i:04d}"


def simulate_main(url: str, first: int, count: int, step_hz: float, seconds: float, phases: int) -> None:
    """Publish for nodes [first, first + count) until `seconds` pass or SIGTERM; print stats as JSON."""
    print(json.dumps(asyncio.run(simulate(url, first, count, step_hz, seconds, phases))), flush=True)


@dataclass
class Job:
    job_id: str
    attempt: int
    ranks: list[int]
    step: int = 0


async def simulate(
    url: str, first: int, count: int, step_hz: float, seconds: float, phases: int
) -> dict[str, Any]:
    nc = await nats.connect(url, pending_size=64 * 1024 * 1024)
    stop = asyncio.Event()
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
    nodes = [node_name(i) for i in range(first, first + count)]
    mine = set(nodes)
    started_at = utcnow()
    devices = {
        n: [Device(index=d, kind="gpu", name="sim-gpu", uuid=f"GPU-{n}-{d}") for d in range(DEVICES)]
        for n in nodes
    }
    jobs: dict[str, Job] = {}
    sent = {"step": 0, "gpu": 0, "heartbeat": 0, "status": 0}

    async def publish(subject: str, event: Any, kind: str) -> None:
        """Into the client's buffer (written out by its flusher, or by `flush`): no acknowledgement wait."""
        sent[kind] += 1
        await nc.publish(subject, event.to_bytes(), headers={"Nats-Msg-Id": event.event_id})

    async def on_launch(msg: Any) -> None:
        launch = LaunchJob.model_validate_json(msg.data)
        for node in {p.node for p in launch.placement} & mine:
            ranks = [p.rank for p in launch.placement if p.node == node]
            jobs[node] = Job(launch.job_id, launch.attempt, ranks)
            for r in ranks:
                started = RankStarted(
                    job_id=launch.job_id, attempt=launch.attempt, rank=r, node=node, pid=1, log_path="-"
                )
                await publish(subjects.status(launch.job_id, node), started, "status")

    await nc.subscribe(subjects.ALL_LAUNCHES, cb=on_launch)
    print("ready", flush=True)
    loop = asyncio.get_running_loop()
    t0, tick, late = loop.time(), 0, []
    hb_every, gpu_every = max(1, round(HEARTBEAT_S * step_hz)), max(1, round(GPU_SAMPLE_S * step_hz))
    while not stop.is_set() and loop.time() - t0 < seconds:
        phase = tick % phases  # the nodes of one phase publish together, the next a fraction of a period on
        target = t0 + tick / (step_hz * phases)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), max(0.0, target - loop.time()))  # the phase's turn
        late.append(loop.time() - target)
        now, period = utcnow(), tick // phases
        for node in nodes[phase::phases]:
            job = jobs.get(node)
            if period % hb_every == 0:
                beat = NodeHeartbeat(
                    node=node,
                    address="127.0.0.1",
                    devices=devices[node],
                    free=[] if job else list(range(DEVICES)),
                    interval_s=HEARTBEAT_S,
                    started_at=started_at,
                )
                await publish(subjects.heartbeat(node), beat, "heartbeat")
            if period % gpu_every == 0:
                for d in range(DEVICES):
                    sample = GpuSampled(
                        node=node, index=d, device_kind="gpu", uuid=f"GPU-{node}-{d}",
                        job_id=job and job.job_id,
                        utilization_pct=97.0, memory_used_bytes=1 << 34, memory_total_bytes=80 << 30,
                        temperature_c=60.0, power_w=400.0,
                    )  # fmt: skip
                    await publish(subjects.gpu(node), sample, "gpu")
            if job:
                for r in job.ranks:
                    await publish(subjects.step(job.job_id, node), _step(job, r, node, now), "step")
                job.step += 1
        await nc.flush()
        tick += 1
    elapsed = loop.time() - t0
    await nc.drain()
    return {
        **sent,
        "elapsed_s": round(elapsed, 3),
        "jobs": len(jobs),
        "max_late_s": round(max(late, default=0.0), 3),
        "p99_late_s": round(percentile(late, 0.99), 3) if late else 0.0,
    }


def _step(job: Job, rank: int, node: str, now: Any) -> StepCompleted:
    return StepCompleted(
        job_id=job.job_id, attempt=job.attempt, rank=rank, node=node, step=job.step,
        loss=3.0 - job.step * 1e-4 + rank * 1e-3, local_finite=True, grad_norm=1.0, lr=3e-4,
        tokens=4096, tokens_per_s=40_000.0, step_time_s=0.9, comm_time_s=0.05, data_time_s=0.01,
        forward_time_s=0.3, backward_time_s=0.5, optimizer_time_s=0.04, data_position=job.step,
        occurred_at=now,
    )  # fmt: skip
