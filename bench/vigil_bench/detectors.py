"""`vigil bench detectors`: labelled step streams through the real bus into the real guardian.

The streams (`vigil_bench.streams`, one job each: clean ones at 1 %, 3 % and 6 % noise, and one per
labelled fault) are replayed concurrently: every tick publishes the next step of every job, each
event stamped with the wall clock as it is published, so the guardian (its own process, as in
production, with every action set to `alert` so that no job stops) sees them as live jobs. The
guardian judges by step index; only hangs are judged by the wall clock, so the publisher keeps the
guardian's backlog short (a backlog of seconds would look like silence). The incidents are read
back from the bus.

It prints, per fault: recall, detection delay (steps; seconds for hangs), whether the incident
names the right rank, and false alarms per 10,000 clean rank-steps per noise level. The last line
is the bench JSON: `value` is the recall over the faults with a target, `floor` the perfect 1.0,
`ok` whether every target holds.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import statistics
import time
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

from vigil.events import (
    IncidentRaised,
    JobStateChanged,
    LaunchJob,
    RankPlacement,
    StepCompleted,
    utcnow,
)
from vigil.spec import JobSpec
from vigil_bench import measure_on_servers, result
from vigil_bench.guardian import _drained, _until, start_guardian
from vigil_bench.streams import NOISE_LEVELS, WORLD, Stream, suite
from vigil_common import subjects
from vigil_common.bus import Bus
from vigil_common.settings import Settings
from vigil_guardian.service import INPUTS

SEED = 11
STEPS = 400
# Clean jobs per noise level: 64 x 4 ranks x 400 steps = 102,400 clean rank-steps at 3 % noise.
CLEAN_JOBS = {0.01: 20, 0.03: 64, 0.06: 20}
MAX_BACKLOG = 3000  # step events the guardian may have pending before the publisher waits
ALERT_ONLY = {k: "alert" for k in ("nan", "spike", "divergence", "imbalance", "straggler", "hang")}
HANG_WAIT_S = 40.0

# Rows of the table with a target: recall (and right rank, where a rank is to blame) of 1.0,
# divergence >= 0.9; false alarms <= 0.1 per 10k clean rank-steps at 3 % noise.
FULL_RECALL = ("nan", "inf", "skipped", "spike", "multi_spike", "grad_explosion", "straggler 30%", "hang")
DIVERGENCE_RECALL = 0.9
FALSE_ALARMS_PER_10K = 0.1


@dataclass
class Row:
    jobs: int = 0
    found: int = 0
    delays: list[float] = field(default_factory=list)
    right: int = 0
    judged_rank: int = 0
    kinds: set[str] = field(default_factory=set)

    def out(self, hang: bool) -> dict[str, Any]:
        return {
            "jobs": self.jobs,
            "recall": round(self.found / self.jobs, 3) if self.jobs else None,
            ("delay_s" if hang else "delay_steps"): _spread(self.delays),
            "right_rank": round(self.right / self.judged_rank, 3) if self.judged_rank else None,
            "kinds": sorted(self.kinds),
        }


def _spread(xs: list[float]) -> dict[str, float] | None:
    if not xs:
        return None
    return {"median": round(statistics.median(xs), 2), "max": round(max(xs), 2)}


def score(
    streams: list[Stream], incidents: dict[str, list[IncidentRaised]], last_sent: dict[str, float]
) -> dict:
    """The table: per fault row, per noise level false alarms (pure: streams and incidents in)."""
    rows: dict[str, Row] = defaultdict(Row)
    clean_steps: dict[float, int] = defaultdict(int)
    false_alarms: dict[float, int] = defaultdict(int)
    early = 0
    for s in streams:
        got = incidents.get(s.name, [])
        if s.label.fault == "clean":
            clean_steps[s.label.noise] += s.rank_steps
            false_alarms[s.label.noise] += len(got)
            continue
        row = rows[s.label.row]
        row.jobs += 1
        onset = s.label.step or 0
        early += sum(1 for i in got if i.step is not None and i.step < onset)
        hits = [i for i in got if i.kind in s.label.expect and (i.step is None or i.step >= onset)]
        row.kinds |= {i.kind for i in got if i.step is None or i.step >= onset}
        if not hits:
            continue
        first = hits[0]
        row.found += 1
        if s.label.fault == "hang":
            row.delays.append(first.occurred_at.timestamp() - last_sent[s.name])
        else:
            row.delays.append((first.step or onset) - onset)
        if s.label.rank is not None:
            row.judged_rank += 1
            row.right += first.rank == s.label.rank
    fa = {
        f"{n:.0%}": {
            "clean_rank_steps": clean_steps[n],
            "false_alarms": false_alarms[n],
            "per_10k": round(1e4 * false_alarms[n] / clean_steps[n], 3) if clean_steps[n] else None,
        }
        for n in sorted(clean_steps)
    }
    table = {k: rows[k].out(k == "hang") for k in sorted(rows)}
    return {"faults": table, "false_alarms": fa, "incidents_before_onset": early}


def verdict(table: dict) -> tuple[bool, list[str], float]:
    """Whether every target holds, the misses, and the recall over the rows with a target."""
    misses = []
    found = jobs = 0
    for key, row in table["faults"].items():
        if key in FULL_RECALL or key.startswith("divergence"):
            found += round(row["recall"] * row["jobs"])
            jobs += row["jobs"]
        if key in FULL_RECALL:
            if row["recall"] < 1.0:
                misses.append(f"{key}: recall {row['recall']}")
            if row["right_rank"] is not None and row["right_rank"] < 1.0:
                misses.append(f"{key}: right rank {row['right_rank']}")
    div = [r for k, r in table["faults"].items() if k.startswith("divergence")]
    if div:
        recall = sum(r["recall"] * r["jobs"] for r in div) / sum(r["jobs"] for r in div)
        if recall < DIVERGENCE_RECALL:
            misses.append(f"divergence: recall {recall:.3f}")
    three = table["false_alarms"].get("3%")
    if three and three["per_10k"] is not None and three["per_10k"] > FALSE_ALARMS_PER_10K:
        misses.append(f"false alarms at 3%: {three['per_10k']} per 10k")
    return not misses, misses, found / jobs if jobs else 1.0


def _event(job: str, s: Any, node: str) -> StepCompleted:
    return StepCompleted(
        job_id=job,
        attempt=1,
        rank=s.rank,
        node=node,
        step=s.step,
        loss=s.loss,
        grad_norm=s.grad_norm,
        lr=s.lr,
        tokens=4096,
        tokens_per_s=4096 / s.step_time_s,
        step_time_s=s.step_time_s,
        comm_time_s=s.comm_time_s,
        skipped=s.skipped,
        data_position=s.step,
        local_finite=s.local_finite,
    )


async def replay(
    settings: Settings, streams: list[Stream], *, hang_wait_s: float = HANG_WAIT_S
) -> tuple[dict[str, list[IncidentRaised]], dict[str, float], dict[str, Any]]:
    """Run the guardian as its own process, replay `streams` into it, return the incidents per job,
    the wall time of each job's last step and some figures about the run."""
    assert settings.nats_url
    guardian, _ = await start_guardian(settings)
    bus = await Bus.connect(settings.nats_url, "bench-detectors")
    incidents: dict[str, list[IncidentRaised]] = defaultdict(list)
    last_sent: dict[str, float] = {}
    try:
        await bus.ensure_streams()
        async with bus.watch(subjects.ALL_INCIDENTS) as watched:
            hangs = asyncio.Event()

            async def collect() -> None:
                async for inc in watched:
                    if isinstance(inc, IncidentRaised) and inc.job_id:
                        incidents[inc.job_id].append(inc)
                        if inc.kind == "hang":
                            hangs.set()

            collector = asyncio.create_task(collect())
            await _until(lambda: _drained(bus), 60.0)  # the guardian is up and consuming
            jobs = {s.name: f"det-{i:04d}" for i, s in enumerate(streams)}
            for s in streams:
                spec = JobSpec(  # the run the window is cut from (the guardian knows where a job ends)
                    name=s.name,
                    resources={"nodes": 1, "gpus_per_node": s.world},
                    train={"steps": s.job_steps},
                    guardian=ALERT_ONLY,
                )
                placement = [
                    RankPlacement(rank=r, node="bench", device=r, local_rank=r) for r in range(s.world)
                ]
                await bus.publish(
                    subjects.launch(jobs[s.name]),
                    LaunchJob(
                        job_id=jobs[s.name],
                        attempt=1,
                        spec=spec,
                        placement=placement,
                        master_addr="127.0.0.1",
                        master_port=29500,
                    ),
                )
            await _until(lambda: _drained(bus), 60.0)
            t0 = time.perf_counter()
            sent = await _publish_steps(bus, streams, jobs, last_sent)
            await _until(lambda: _drained(bus), 120.0)
            judged_s = time.perf_counter() - t0
            for s in streams:
                if s.label.fault != "hang":
                    await bus.publish(
                        subjects.status(jobs[s.name], subjects.CONTROL),
                        JobStateChanged(
                            job_id=jobs[s.name],
                            attempt=1,
                            from_state="RUNNING",
                            to_state="SUCCEEDED",
                            cause="bench stream over",
                        ),
                    )
            hung = [jobs[s.name] for s in streams if s.label.fault == "hang"]
            deadline = time.monotonic() + hang_wait_s
            # the guardian judges hangs by the wall clock: wait for each hung job's incident
            while not all(any(i.kind == "hang" for i in incidents.get(j, [])) for j in hung):
                hangs.clear()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(hangs.wait(), max(0.0, deadline - time.monotonic()))
                if time.monotonic() >= deadline:
                    break
            await _until(lambda: _drained(bus), 60.0)
            collector.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await collector
    finally:
        guardian.send_signal(signal.SIGTERM)
        try:
            await asyncio.wait_for(guardian.wait(), 15)
        except TimeoutError:
            guardian.kill()
        await bus.close()
    by_name = {jobs[s.name]: s.name for s in streams}
    named = {by_name[j]: v for j, v in incidents.items() if j in by_name}
    return (
        named,
        {by_name[j]: t for j, t in last_sent.items()},
        {
            "step_events": sent,
            "judged_per_s": round(sent / judged_s, 1),
        },
    )


async def _publish_steps(
    bus: Bus, streams: list[Stream], jobs: dict[str, str], last_sent: dict[str, float]
) -> int:
    """Tick by tick, every job's next step (all its ranks) at once; the backlog kept short."""
    sent = 0
    longest = max(len(s.steps) for s in streams)
    for k in range(longest):
        batch = [
            (subjects.step(jobs[s.name], "bench"), _event(jobs[s.name], rs, "bench"))
            for s in streams
            if k < len(s.steps)
            for rs in s.steps[k]
        ]
        await asyncio.gather(*(bus.publish(subject, e) for subject, e in batch))
        now = utcnow().timestamp()
        for s in streams:
            if k == len(s.steps) - 1:
                last_sent[jobs[s.name]] = now
        sent += len(batch)
        await _backlog_below(bus, MAX_BACKLOG)
    return sent


async def _backlog_below(bus: Bus, limit: int) -> None:
    while True:
        infos = [await bus.js.consumer_info(spec.stream.name, spec.durable) for spec in INPUTS]
        if sum(info.num_pending + info.num_ack_pending for info in infos) <= limit:
            return
        await asyncio.sleep(0.02)  # the guardian is working through its backlog


def render(table: dict) -> str:
    """The table as Markdown (what the README shows)."""
    lines = [
        "| fault | jobs | recall | delay (median / max) | right rank | incident kinds |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for key, row in table["faults"].items():
        d = row.get("delay_s") or row.get("delay_steps")
        unit = " s" if "delay_s" in row else " steps"
        delay = f"{d['median']:g} / {d['max']:g}{unit}" if d else "-"
        rr = "n/a" if row["right_rank"] is None else f"{row['right_rank']:.2f}"
        lines.append(
            f"| {key} | {row['jobs']} | {row['recall']:.2f} | {delay} | {rr} | {', '.join(row['kinds'])} |"
        )
    lines += ["", "| noise | clean rank-steps | false alarms | per 10k |", "| --- | --- | --- | --- |"]
    for noise, fa in table["false_alarms"].items():
        lines.append(f"| {noise} | {fa['clean_rank_steps']} | {fa['false_alarms']} | {fa['per_10k']} |")
    return "\n".join(lines)


async def evaluate(
    settings: Settings,
    *,
    seed: int = SEED,
    steps: int = STEPS,
    clean_jobs: dict[float, int] = CLEAN_JOBS,
    hang_wait_s: float = HANG_WAIT_S,
    small: bool = False,
) -> dict[str, Any]:
    """Generate, replay and score one evaluation; the bench result (`small`: one job per row)."""
    streams = suite(seed, steps=steps, clean_jobs=clean_jobs, small=small)
    t0 = time.perf_counter()
    incidents, last_sent, figures = await replay(settings, streams, hang_wait_s=hang_wait_s)
    table = score(streams, incidents, last_sent)
    ok, misses, recall = verdict(table)
    print(render(table), flush=True)
    return result(
        "detectors",
        value=recall,
        floor=1.0,
        unit="recall over the faults with a target",
        target="recall 1.0 for nan, spikes >= 2x, 30% stragglers, hangs (right rank); divergence >= 0.9; "
        "<= 0.1 false alarms per 10k clean rank-steps at 3% noise",
        ok=ok,
        misses=misses,
        seed=seed,
        world=WORLD,
        noise_levels=[f"{n:.0%}" for n in NOISE_LEVELS],
        wall_s=round(time.perf_counter() - t0, 1),
        **figures,
        **table,
    )


async def run(settings: Settings) -> dict[str, Any]:
    return await measure_on_servers(evaluate, settings)
