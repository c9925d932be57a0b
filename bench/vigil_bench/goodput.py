"""`vigil bench goodput`: the share of wall time a job keeps for useful training under a mixed set of
faults.

The whole stack runs in this process (scheduler and gateway, telemetry, guardian, a worker of two CPU
slots, as `vigil up`) on the user's servers or embedded ones. The same two-rank DeepSpeed job (tiny GPT,
ZeRO-1) runs three times, one after the other (after a short warm-up job): fault-free, then with five
faults, one of each kind: a silent data corruption (held, replayed clean), a NaN and a loss spike in the
data (held, reproduced, their data skipped), a crashed rank and a hung one (both relaunched from the
newest snapshot), then fault-free again. All runs do the same useful steps; goodput = fault-free wall
time / faulted wall time, each from submission to SUCCEEDED, the fault-free time (the floor) the mean of
the runs before and after the faulted one: one fault-free run alone, taken before, let the machine's drift
over the minutes between them (1-3 s in a 47 s run here) decide the figure either way. Fault-free runs
more than 10 % apart make the run `steady: false` (and not `ok`): the machine, not Vigil, moved. Target
>= 0.90 on this dense bench (5 faults in 300 steps).

The worker keeps 6 warm ranks (`VIGIL_WARM_RANKS`: the launch's and two relaunches' worth of two ranks,
since a CPU node replaces a taken one only once the job's ranks are done, unless the pool is short of
one relaunch), and each run starts once they are all ready.

Per fault, the time it cost, from the job's own events: a held step's time beyond the median step; a
relaunch's time from the last step done before it to the same progress after it, less one step (it is
detection, the new ranks' start and load, and the steps redone since the checkpoint). The held-step
kinds alone give `goodput_held`: what the rest of the table would be without a relaunch. A relaunch's
`relaunch_s` is from its cause (the crashed rank's exit, the hang's incident) to the new attempt's first
step; a hang's `detect_s`, from its last step to the incident. Targets per fault: a held one <= one step;
a crash <= 1 s plus the steps redone; a hang <= its detection plus 1 s.

`goodput_realistic` is what a 1,024-GPU job would keep at Llama 3's interruption rate (466 in 54 days on
16,384 GPUs, 2.2e-5 per GPU-hour) if each interruption cost what the crash cost here (its relaunch and
the steps redone): it leaves out what grows with a real job (the checkpoint's load, a longer step).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import statistics
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from vigil import events as ev
from vigil.events import StepCompleted
from vigil_bench import measure_on_servers, result
from vigil_cli.stack import run_services
from vigil_common import subjects
from vigil_common.bus import Bus
from vigil_common.embedded import free_port
from vigil_common.settings import Settings

STEPS = 300
WARM_RANKS = 6
LLAMA3_PER_GPU_HOUR = 466 / (54 * 24 * 16_384)  # interruptions (The Llama 3 Herd of Models, sec. 3.3.4)
REALISTIC_GPUS = 1024
RELAUNCHED_BY = ("rank_exit", "hang", "node_lost", "gpu_health", "sdc")
TOKEN = "bench-goodput-" + uuid.uuid4().hex
STEADY = 1.10  # the fault-free runs within 10 % of each other, or the run says the machine was not steady
FAULTS = [
    {"kind": "sdc", "step": 40, "rank": 1},
    {"kind": "nan", "step": 80, "rank": 0},
    {"kind": "spike", "step": 120, "rank": 1, "factor": 50},
    {"kind": "crash", "step": 165, "rank": 1},
    {"kind": "hang", "step": 235, "rank": 0},
]


def spec(faults: list[dict[str, Any]]) -> dict[str, Any]:
    return {
        "name": "bench-goodput",
        "resources": {"nodes": 1, "gpus_per_node": 2},
        "model": {"preset": "tiny", "n_layer": 2, "seq_len": 64},
        "train": {"steps": STEPS, "micro_batch": 4, "lr": 1e-3, "warmup_steps": 2, "zero_stage": 1},
        # an in-memory snapshot every step: "auto" measures its interval on the machine it runs on, and
        # on a loaded one chose 12 steps, so a crash redid up to 12 steps in one run and 1 in the next
        "checkpoint": {"every": 25, "keep": 3, "memory_every": 1},
        # a hang is judged on 10 x the job's p99 step time (about 0.7 s here), no sooner than 1 s
        "guardian": {"hang_step_multiple": 10, "hang_timeout_s": 60, "hang_floor_s": 1.0, "spike_warmup": 10},
        "faults": faults,
    }


@dataclass
class Run:
    job_id: str = ""
    wall_s: float = 0.0
    events: list[ev.Message] = field(default_factory=list)

    def of(self, cls: type[ev.Message]) -> list[Any]:
        return [e for e in self.events if isinstance(e, cls)]


async def train(http: httpx.AsyncClient, bus: Bus, body: dict[str, Any], timeout_s: float) -> Run:
    run, ended = Run(), asyncio.Event()
    watched = (subjects.ALL_LAUNCHES, subjects.ALL_STEPS, subjects.ALL_STATUS, subjects.ALL_CMDS)
    async with bus.watch(*watched, subjects.ALL_INCIDENTS) as events:

        async def collect() -> None:
            async for e in events:
                if e.job_id == run.job_id:
                    run.events.append(e)
                    if isinstance(e, ev.JobStateChanged) and e.to_state in ev.TERMINAL_STATES:
                        ended.set()

        collector = asyncio.create_task(collect())
        t0 = time.perf_counter()
        response = await http.post("/api/v1/jobs", json=body)
        response.raise_for_status()
        run.job_id = response.json()["id"]
        try:
            await asyncio.wait_for(ended.wait(), timeout_s)
        finally:
            run.wall_s = time.perf_counter() - t0
            collector.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await collector
    state = run.of(ev.JobStateChanged)[-1].to_state
    if state != "SUCCEEDED":
        raise RuntimeError(f"bench job {run.job_id} ended {state}")
    return run


def time_lost(run: Run) -> list[dict[str, Any]]:
    """What each fault cost (see the module's docstring)."""
    rank0 = [e for e in run.of(ev.StepCompleted) if e.rank == 0]
    median = statistics.median(e.step_time_s for e in rank0)
    rows = []
    for held in run.of(ev.StepReplayed):
        step = next(e for e in rank0 if e.step == held.step and e.attempt == held.attempt)
        rows.append(
            {
                "fault": "sdc" if held.outcome == "transient" else held.kind,
                "step": held.step,
                "recovery": "replayed (transient)" if held.outcome == "transient" else "data skipped",
                "lost_s": round(step.step_time_s - median, 3),
            }
        )
    for launch in run.of(ev.LaunchJob):
        if launch.attempt == 1:
            continue
        old = launch.attempt - 1
        before = [e for e in rank0 if e.attempt == old]
        last = max(before, key=lambda e: e.step)
        again = min(
            (e for e in rank0 if e.attempt >= launch.attempt and e.step == last.step + 1),
            key=lambda e: e.occurred_at,
        )
        why = next(
            (i.kind for i in run.of(ev.IncidentRaised) if i.attempt == old and i.kind in RELAUNCHED_BY), "?"
        )
        lost = (again.occurred_at - last.occurred_at).total_seconds() - median
        checkpoint = int(Path(launch.resume_from).name.removeprefix("step_")) if launch.resume_from else 0
        resumed = min(e.step for e in rank0 if e.attempt == launch.attempt)  # a snapshot may be newer
        redone = last.step + 1 - resumed
        fault = {"rank_exit": "crash"}.get(why, why)
        first = min(e.occurred_at for e in rank0 if e.attempt == launch.attempt)
        causes = [e.occurred_at for e in run.of(ev.RankExited) if e.attempt == old and e.failure != "ok"]
        if fault == "hang":
            causes = [
                i.occurred_at for i in run.of(ev.IncidentRaised) if i.attempt == old and i.kind == "hang"
            ]
        row: dict[str, Any] = {
            "fault": fault,
            "step": last.step + 1,
            "recovery": f"relaunched from step {resumed} ({redone} redone; "
            + (
                "an in-memory snapshot"
                if resumed > checkpoint
                else f"the disk checkpoint of step {checkpoint}"
            )
            + ")",
            "lost_s": round(lost, 3),
        }
        if causes:
            row["relaunch_s"] = round((first - min(causes)).total_seconds(), 3)
        if fault == "hang" and causes:
            row["detect_s"] = round((min(causes) - last.occurred_at).total_seconds(), 3)
            row["target_s"] = round(row["detect_s"] + 1.0, 3)
        elif fault == "crash":
            row["target_s"] = round(1.0 + redone * median, 3)
        rows.append(row)
    for row in rows:
        row.setdefault("target_s", round(median, 3))  # a held step: one step
        row["ok"] = row["lost_s"] <= row["target_s"]
    return sorted(rows, key=lambda r: r["step"])


async def _measure(settings: Settings) -> dict[str, Any]:
    port = free_port()
    settings = settings.model_copy(
        update={
            "http_port": port,
            "api_token": TOKEN,
            "node_name": "bench-goodput-" + uuid.uuid4().hex[:6],
            "cpu_slots": 2,
            "heartbeat_interval_s": 0.5,
            "warm_ranks": WARM_RANKS,
        }
    )
    warm = WarmPool()
    stop = asyncio.Event()
    services = asyncio.create_task(run_services(settings, stop))
    bus = await Bus.connect(settings.nats_url, "bench-goodput")
    http = httpx.AsyncClient(
        base_url=f"http://127.0.0.1:{port}", headers={"Authorization": f"Bearer {TOKEN}"}
    )
    try:
        deadline = time.monotonic() + 120
        while True:  # the gateway answers and the worker registered (polled while the stack starts)
            if services.done():
                services.result()
            with contextlib.suppress(httpx.HTTPError):
                nodes = (await http.get("/api/v1/nodes")).json().get("items", [])
                if any(n["alive"] for n in nodes):
                    break
            if time.monotonic() > deadline:
                raise TimeoutError("the stack did not come up within 120s")
            await asyncio.sleep(0.2)
        first = {**spec([]), "train": {**spec([])["train"], "steps": 5}}
        await warm.full(300)
        await train(http, bus, first, timeout_s=300)  # first-run costs (page cache, imports) go here
        cleans = []
        await warm.full(300)
        cleans.append(await train(http, bus, spec([]), timeout_s=900))
        await warm.full(300)
        faulted = await train(http, bus, spec(FAULTS), timeout_s=900)
        await warm.full(300)
        cleans.append(await train(http, bus, spec([]), timeout_s=900))
    finally:
        warm.close()
        stop.set()
        await asyncio.wait_for(services, 60)
        await http.aclose()
        await bus.close()

    rows = time_lost(faulted)
    held = sum(r["lost_s"] for r in rows if r["fault"] in ("sdc", "nan", "spike"))
    floor = statistics.mean(c.wall_s for c in cleans)  # before and after the faulted run
    goodput = floor / faulted.wall_s
    # the two fault-free runs far apart: the machine was not steady (once, here, 101 s against 46 s with no
    # incident), and no figure of this run is a measure of Vigil
    steady = max(c.wall_s for c in cleans) <= STEADY * min(c.wall_s for c in cleans)
    crash = [r["lost_s"] for r in rows if r["fault"] == "crash"]
    per_hour = LLAMA3_PER_GPU_HOUR * REALISTIC_GPUS
    realistic = 1 / (1 + per_hour * crash[0] / 3600) if crash else None
    return result(
        "goodput",
        faulted.wall_s,
        floor,
        unit="s of wall time for the same useful steps (faulted, fault-free: the mean of the runs around it)",
        target="goodput = floor / value >= 0.90",
        goodput=round(goodput, 4),
        fault_free_s=[round(c.wall_s, 3) for c in cleans],
        goodput_held=round(floor / (floor + held), 4),
        goodput_realistic=round(realistic, 6) if realistic is not None else None,
        realistic=f"{REALISTIC_GPUS} GPUs, {per_hour:.4f} interruptions/hour, each costing the crash's time",
        warm_ranks=WARM_RANKS,
        steps=STEPS,
        median_step_s=round(statistics.median(e.step_time_s for c in cleans for e in c.of(StepCompleted)), 4),
        faults=rows,
        unexplained_s=round(faulted.wall_s - floor - sum(r["lost_s"] for r in rows), 3),
        rollbacks=len(faulted.of(ev.RollbackCompleted)),
        steady=steady,
        ok=steady and goodput >= 0.90 and all(r["ok"] for r in rows),
    )


class WarmPool(logging.Handler):
    """Hears the worker (in this process) say its warm ranks are all ready."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.ready = asyncio.Event()
        self.loop = asyncio.get_running_loop()
        worker = logging.getLogger("vigil.worker")
        worker.setLevel(logging.INFO)  # its INFO records reach this handler (nothing more is printed)
        worker.addHandler(self)

    def emit(self, record: logging.LogRecord) -> None:
        if record.getMessage().endswith("warm rank(s) ready"):
            self.loop.call_soon_threadsafe(self.ready.set)

    async def full(self, timeout_s: float) -> None:
        """Return once the pool has been full since the last call."""
        await asyncio.wait_for(self.ready.wait(), timeout_s)
        self.ready.clear()

    def close(self) -> None:
        logging.getLogger("vigil.worker").removeHandler(self)
        super().close()


async def run(settings: Settings) -> dict[str, Any]:
    return await measure_on_servers(_measure, settings)
