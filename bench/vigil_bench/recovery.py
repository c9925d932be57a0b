"""`vigil bench recovery`: how long an in-place rollback takes, against DeepSpeed's own load.

A two-rank DeepSpeed job (tiny GPT, ZeRO-1, CPU) trains with events and commands on a real NATS. The
bench publishes `RollbackJob` to the step-10 checkpoint while the job trains past it, ROLLBACKS times
(each at a random point of a step),
and measures, as seen on the bus, the time from publishing the command to the arrival of the first
step completed after it (the ranks finish the step in flight, agree on the command, verify the
manifest's SHA-256s, load, and run the step). The floor, measured in the same run, is what any
in-place rollback must spend: the rest of the step that was running when the command arrived (ranks
cannot leave it mid-collective; measured by rank 0 from the command's arrival to that step's end),
DeepSpeed's own `load_checkpoint` of the same checkpoint (timed inside the ranks, which run as
`python -m vigil_bench.timed_rank` to write it down), and the first
training step after it (its own measured time). Target: ratio <= 1.5. `ratio_without_in_flight`
leaves the step in flight out of the floor, for a stricter view.
It also reports `restart_s`: a full restart of the ranks from the same checkpoint (new processes,
process group, engine, load) to their first step.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
import statistics
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import yaml

from vigil import events as ev
from vigil_bench import result, servers
from vigil_common import subjects
from vigil_common.bus import Bus
from vigil_common.settings import Settings
from vigil_trainer.checkpoint import step_dir
from vigil_worker.local import LocalAgent, start_ranks

ROLLBACKS = 5
SPEC = {
    "name": "bench-recovery",
    "resources": {"gpus_per_node": 2},
    "model": {"preset": "tiny", "seq_len": 64},
    "train": {"steps": 100_000, "micro_batch": 4, "zero_stage": 1, "warmup_steps": 2},
    # the disk path, against DeepSpeed's own load of the same files: a rollback to a step held in memory
    # (`checkpoint.memory_every`) reads none, and its load would not be DeepSpeed's
    "checkpoint": {"every": 10, "keep": 3, "memory_every": 0},
}


class Seen:
    """Events of one job with their arrival times, and a way to wait for one."""

    def __init__(self) -> None:
        self.events: list[tuple[float, ev.Message]] = []
        self.changed = asyncio.Condition()

    async def add(self, event: ev.Message) -> None:
        async with self.changed:
            self.events.append((time.perf_counter(), event))
            self.changed.notify_all()

    async def first(self, match: Callable[[ev.Message], bool], after: int = 0, timeout: float = 120.0) -> int:
        """Index of the first event from `after` on that matches."""

        async def wait() -> int:
            async with self.changed:
                while True:
                    for i in range(after, len(self.events)):
                        if match(self.events[i][1]):
                            return i
                    await self.changed.wait()

        return await asyncio.wait_for(wait(), timeout)


def _step(step: int, attempt: int = 1) -> Callable[[ev.Message], bool]:
    return lambda e: (
        isinstance(e, ev.StepCompleted) and e.rank == 0 and e.step == step and e.attempt == attempt
    )


async def _measure(url: str, tmp: Path) -> dict[str, Any]:
    bus = await Bus.connect(url, "bench-recovery")
    await bus.ensure_streams()
    job = "bench-recovery-" + uuid.uuid4().hex[:8]
    root = tmp / "ckpt"
    (tmp / "spec.yaml").write_text(yaml.safe_dump(SPEC))
    common = ["--spec", str(tmp / "spec.yaml"), "--job-id", job, "--checkpoint-root", str(root),
              "--cache-dir", str(tmp / "cache")]  # fmt: skip
    agent = LocalAgent(url, root).__enter__()
    seen = Seen()
    async with bus.watch(subjects.step(job, agent.node), subjects.status(job, agent.node)) as stream:

        async def pump() -> None:
            async for event in stream:
                await seen.add(event)

        pumping = asyncio.create_task(pump())
        timed = ["--timings", str(tmp / "timings.jsonl"), *common]
        ranks = start_ranks(timed, 2, tmp / "run", module="vigil_bench.timed_rank", agent=agent, job=(job, 1))
        try:
            await seen.first(lambda e: isinstance(e, ev.CheckpointSaved) and e.step == 10, timeout=180)
            mark = await seen.first(_step(12))
            target = step_dir(root, job, 10)
            took, first_steps = [], []
            jitter = random.Random(0)
            step_s = seen.events[mark][1].step_time_s  # type: ignore[attr-defined]
            for _ in range(ROLLBACKS):
                # commands come at any point of a step: publish at a random offset into one
                await asyncio.sleep(jitter.uniform(0, step_s))
                sent = time.perf_counter()
                await bus.publish(
                    subjects.cmd(job),
                    ev.RollbackJob(job_id=job, attempt=1, checkpoint=str(target), step=10, reason="bench"),
                )
                done = await seen.first(lambda e: isinstance(e, ev.RollbackCompleted), after=mark + 1)
                first = await seen.first(_step(10), after=done)
                took.append(seen.events[first][0] - sent)
                first_steps.append(seen.events[first][1].step_time_s)  # type: ignore[attr-defined]
                mark = await seen.first(_step(12), after=first)
            steps = [e.step_time_s for _, e in seen.events if isinstance(e, ev.StepCompleted) and e.rank == 0]
        finally:
            ranks.kill()
        records = [
            r
            for line in (tmp / "timings.jsonl").read_text().splitlines()
            if (r := json.loads(line))["event"] == "rollback" and r["rank"] == 0
        ]

        # a full restart from the same checkpoint: new processes through to their first step
        sent = time.perf_counter()
        again = start_ranks(
            [*common, "--attempt", "2", "--resume-from", str(target)],
            2,
            tmp / "restart",
            agent=agent,
            job=(job, 2),
        )
        try:
            first = await seen.first(_step(10, attempt=2), timeout=180)
            restart_s = seen.events[first][0] - sent
        finally:
            again.kill()
        pumping.cancel()
    await asyncio.to_thread(agent.__exit__, None, None, None)
    await bus.close()
    step_s = statistics.median(steps)
    return {
        "took": took,
        "first_steps": first_steps,
        "records": records,
        "step_s": step_s,
        "restart_s": restart_s,
    }


def run(settings: Settings) -> dict[str, object]:
    with contextlib.ExitStack() as stack:
        settings, _ = servers(stack, settings, database=False)
        tmp, url = settings.data_dir, settings.nats_url
        assert url
        m = asyncio.run(_measure(url, tmp))
    value = statistics.median(m["took"])
    load = statistics.median(r["load_s"] for r in m["records"])
    in_flight = statistics.median(r["in_flight_s"] for r in m["records"])
    # per rollback: the step in flight + DeepSpeed's load + the first step after it (its own time)
    floors = [r["in_flight_s"] + r["load_s"] + s for r, s in zip(m["records"], m["first_steps"], strict=True)]
    floor = statistics.median(floors)
    return result(
        "recovery",
        value,
        floor,
        "s",
        "ratio <= 1.5",
        rollbacks=[round(t, 4) for t in m["took"]],
        deepspeed_load_s=round(load, 4),
        step_s=round(m["step_s"], 4),
        in_flight_s=round(in_flight, 4),
        waited_s=round(statistics.median(r["waited_s"] for r in m["records"]), 4),
        rollback_in_ranks_s=round(statistics.median(r["total_s"] for r in m["records"]), 4),
        ratio_without_in_flight=round(value / (load + m["step_s"]), 4),
        restart_s=round(m["restart_s"], 3),
        restart_ratio=round(m["restart_s"] / floor, 2),
        config="tiny GPT 3.2M params, seq 64, micro-batch 4, 2 ranks, ZeRO-1, fp32, CPU/gloo",
    )
