"""`vigil bench fleet`: a simulated fleet through the real scheduler, telemetry and guardian processes.

Each service runs as its own process with its own NATS role (see `vigil_common.credentials`), on
embedded NATS and Postgres: the scheduler, `VIGIL_BENCH_FLEET_TELEMETRY` telemetry replicas (one
shared step consumer) and `VIGIL_BENCH_FLEET_GUARDIANS` guardians (dividing the jobs' shares).
Simulated nodes (no ranks: `VIGIL_BENCH_FLEET_SIMULATORS` processes, each publishing for its share of
the nodes) heartbeat with 8 devices, sample every device
every few seconds, and once the scheduler has placed a job on them (one 8-device job per node,
submitted through the gateway) report its ranks started and publish one step event per rank at
`VIGIL_BENCH_FLEET_STEP_HZ`, each node at its own phase of the step period
(`VIGIL_BENCH_FLEET_PHASES` groups; 1 sends the whole fleet's steps in one burst). Load events go
out on core NATS with `Nats-Msg-Id` (the streams store them as they store any publish):
the generator's own acknowledgement waits are not the system's cost.

Measured, with the machine's load average beside each figure:
- the event rate held: step events published per second (and stored by telemetry) against the target;
- telemetry lag: the step consumer's unacknowledged backlog, sampled through the run; `lag_growing`
  compares its last third with its first;
- guardian detect-to-command: a probe job's NaN step published -> its HaltJob received by a core
  subscriber of the command subjects, p99 idle (before the fleet starts: the floor) and under load
  (the value); the ratio is load over idle;
- Postgres growth per million steps stored, and CPU seconds per component (where the time goes).

When the target is not met, `holding_back` says why, from what was sampled every half second: every
durable consumer's backlog (`consumers`: growing, or never caught up), every process's CPU (a Python
service is one core at most; the machine's cores), the generator's lateness, slow-consumer drops in a
process's log (each process's stderr is kept in the run's data dir) and the guardian's own figures;
`timeline` shows backlogs and CPU shares about every ten seconds.

Defaults are the target: 256 nodes x 8 ranks at 1 step/s for 120 s with 2 guardians; ratio <= 3 with no lag
growing. `events_per_s_by_guardian` is what each guardian judged (its shares' consumers' deliveries).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import os
import signal
import statistics
import sys
import tempfile
import time
import uuid
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import nats
import nats.errors
import nats.js.errors
from nats.js.api import ConsumerInfo

from vigil.events import (
    CheckpointSaved,
    Device,
    GpuSampled,
    JobStateChanged,
    LaunchJob,
    NodeHeartbeat,
    RankPlacement,
    RankStarted,
    StepCompleted,
    utcnow,
)
from vigil.spec import JobSpec
from vigil_bench import percentile, result
from vigil_common import credentials, lease, subjects
from vigil_common.bus import Bus
from vigil_common.db import create_pool, migrate
from vigil_common.embedded import EmbeddedNats, EmbeddedPostgres, free_port
from vigil_common.settings import Settings
from vigil_guardian.inputs import job_input, last_stored

DEVICES = 8
HEARTBEAT_S = 2.0
GPU_SAMPLE_S = 5.0
PROBE_EVERY_S = 1.0
IDLE_PROBES = 60
LAG_SAMPLE_S = 0.5
TOKEN = "bench-fleet-token-" + "x" * 16


@dataclass(frozen=True)
class Plan:
    nodes: int = 256
    step_hz: float = 1.0
    seconds: float = 120.0
    telemetry: int = 1
    guardians: int = 2
    simulators: int = 1
    # Each node steps at its own phase of the period, in this many groups (1: every rank of the fleet
    # at the same instant, a burst no real fleet of independent jobs sends).
    phases: int = 16

    @classmethod
    def from_env(cls) -> Plan:
        env = os.environ.get
        return cls(
            nodes=int(env("VIGIL_BENCH_FLEET_NODES", cls.nodes)),
            step_hz=float(env("VIGIL_BENCH_FLEET_STEP_HZ", cls.step_hz)),
            seconds=float(env("VIGIL_BENCH_FLEET_SECONDS", cls.seconds)),
            telemetry=int(env("VIGIL_BENCH_FLEET_TELEMETRY", cls.telemetry)),
            guardians=int(env("VIGIL_BENCH_FLEET_GUARDIANS", cls.guardians)),
            simulators=int(env("VIGIL_BENCH_FLEET_SIMULATORS", cls.simulators)),
            phases=int(env("VIGIL_BENCH_FLEET_PHASES", cls.phases)),
        )

    @property
    def target_rate(self) -> float:
        return self.nodes * DEVICES * self.step_hz


# --- the simulated nodes (a process of its own) ---------------------------------------------------------


def node_name(i: int) -> str:
    return f"sim-{i:04d}"


def simulate_main(url: str, first: int, count: int, step_hz: float, seconds: float, phases: int) -> None:
    """Publish for nodes [first, first + count) until `seconds` pass or SIGTERM; print stats as JSON."""
    print(json.dumps(asyncio.run(_simulate(url, first, count, step_hz, seconds, phases))), flush=True)


@dataclass
class _Job:
    job_id: str
    attempt: int
    ranks: list[int]
    step: int = 0


async def _simulate(
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
    jobs: dict[str, _Job] = {}
    sent = {"step": 0, "gpu": 0, "heartbeat": 0, "status": 0}

    async def publish(subject: str, event: Any, kind: str) -> None:
        """Into the client's buffer (written out by its flusher, or by `flush`): no acknowledgement wait."""
        sent[kind] += 1
        await nc.publish(subject, event.to_bytes(), headers={"Nats-Msg-Id": event.event_id})

    async def on_launch(msg: Any) -> None:
        launch = LaunchJob.model_validate_json(msg.data)
        for node in {p.node for p in launch.placement} & mine:
            ranks = [p.rank for p in launch.placement if p.node == node]
            jobs[node] = _Job(launch.job_id, launch.attempt, ranks)
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


def _step(job: _Job, rank: int, node: str, now: Any) -> StepCompleted:
    return StepCompleted(
        job_id=job.job_id, attempt=job.attempt, rank=rank, node=node, step=job.step,
        loss=3.0 - job.step * 1e-4 + rank * 1e-3, local_finite=True, grad_norm=1.0, lr=3e-4,
        tokens=4096, tokens_per_s=40_000.0, step_time_s=0.9, comm_time_s=0.05, data_time_s=0.01,
        forward_time_s=0.3, backward_time_s=0.5, optimizer_time_s=0.04, data_position=job.step,
        occurred_at=now,
    )  # fmt: skip


# --- the probes: guardian detect-to-command -------------------------------------------------------------


class _Halts:
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


async def _consumer_idle(bus: Bus, stream: str, durable: str) -> bool:
    try:
        info = await bus.js.consumer_info(stream, durable)
    except Exception:
        return False
    return not (info.num_pending or info.num_ack_pending)


def _steps_stream() -> str:
    return subjects.stream_for(subjects.ALL_STEPS).name


async def _durables(bus: Bus, streams: Iterable[str] | None = None) -> list[ConsumerInfo]:
    """Every durable consumer on `streams` (all of them unless told)."""
    found = []
    for stream in streams if streams is not None else [spec.name for spec in subjects.STREAMS]:
        with contextlib.suppress(nats.js.errors.NotFoundError):
            found += [c for c in await bus.js.consumers_info(stream) if c.config.durable_name]
    return found


def _backlog(info: ConsumerInfo) -> int:
    return (info.num_pending or 0) + (info.num_ack_pending or 0)


async def _guardian_idle(bus: Bus) -> bool:
    """Every share's consumer exists and is caught up."""
    mine = {c.name: c for c in await _durables(bus, [subjects.JOBS.name])}
    inputs = [credentials.guardian_input(k) for k in range(subjects.SHARES)]
    return all(name in mine and not _backlog(mine[name]) for name in inputs)


async def _guardians_divided(pool: Any, n: int) -> bool:
    """`n` guardians hold all the shares, each its fair part."""
    held = [h.shares for h in await lease.holders(pool) if h.role == "guardian"]
    fair = math.ceil(subjects.SHARES / n)
    return len(held) == n and sum(map(len, held)) == subjects.SHARES and all(len(s) <= fair for s in held)


async def _guardian_has(bus: Bus, job: str) -> bool:
    """The consumer of the job's share has acknowledged every event published of the job so far."""
    seq = await last_stored(bus, job)
    if seq is None:
        return False  # not stored yet
    spec = job_input(job)
    info = await bus.js.consumer_info(spec.stream.name, spec.durable)
    return (info.ack_floor.stream_seq if info.ack_floor else 0) >= seq


async def _judged_by_guardian(pool: Any, bus: Bus) -> dict[str, int]:
    """Per guardian (pid@host), the messages its shares' consumers have had delivered and acknowledged."""
    acked = {
        c.name: c.ack_floor.consumer_seq if c.ack_floor else 0
        for c in await _durables(bus, [subjects.JOBS.name])
    }
    return {
        h.instance: sum(acked.get(credentials.guardian_input(k), 0) for k in h.shares)
        for h in await lease.holders(pool)
        if h.role == "guardian"
    }


@dataclass
class _Stages:
    """Where a probe's time went, from the server's store times: the NaN step stored in VIGIL_JOBS (under
    its share: no copy since VIGIL_SHARES went) -> the guardian's HaltJob stored in VIGIL_COMMANDS
    (`judge`: delivery, judging, publishing)."""

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
        for name, values in (("judge", self.judge),):
            out[f"{name}_p50_ms"] = round(statistics.median(values) * 1e3, 2) if values else None
            out[f"{name}_p99_ms"] = round(percentile(values, 0.99) * 1e3, 2) if values else None
        return out


async def _probe(
    bus: Bus, halts: _Halts, spec: JobSpec, stages: _Stages, timeout_s: float = 30.0
) -> float | None:
    """Seconds from a probe job's NaN step to its HaltJob; None when none came within `timeout_s`."""
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
        CheckpointSaved(job_id=job, attempt=1, step=0, path=f"/probe/{job}", bytes=1, manifest_sha256="x",
                        data_position=0),
    )  # fmt: skip
    # the guardian knows the job (its launch and checkpoint acknowledged) before its steps come
    deadline = time.monotonic() + timeout_s
    while not await _guardian_has(bus, job):
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
    arrived = await halts.wait(job, timeout_s)
    if arrived is not None:
        await stages.add(bus, job)
    await bus.publish(
        subjects.status(job, subjects.CONTROL),
        JobStateChanged(job_id=job, attempt=1, from_state="HALTED", to_state="CANCELLED", cause="probe over"),
    )
    return None if arrived is None else arrived - t0


# --- the processes -----------------------------------------------------------------------------------------

_SERVICE = (
    "import sys; from vigil_common.service import run_service; from vigil_common.settings import Settings; "
    "import importlib; run_service(importlib.import_module(sys.argv[1]).run, Settings.load())"
)
_SIMULATOR = (
    "import sys; from vigil_bench.fleet import simulate_main as m; "
    "m(sys.argv[1], *map(int, sys.argv[2:4]), *map(float, sys.argv[4:6]), int(sys.argv[6]))"
)


@dataclass
class _Procs:
    logs: Path  # each process's stderr, as <name>.log
    named: dict[str, asyncio.subprocess.Process] = field(default_factory=dict)

    async def start(
        self, name: str, *args: str, env: dict[str, str], stdout: Any = None
    ) -> asyncio.subprocess.Process:
        self.logs.mkdir(parents=True, exist_ok=True)
        with (self.logs / f"{name}.log").open("ab") as log:
            proc = await asyncio.create_subprocess_exec(
                sys.executable, "-c", *args, env=env, stdout=stdout, stderr=log
            )
        self.named[name] = proc
        return proc

    def log_counts(self) -> dict[str, dict[str, int]]:
        """Per process, its log's lines that tell of trouble (nats-py's slow-consumer drops, errors)."""
        out = {}
        for name in self.named:
            text = (self.logs / f"{name}.log").read_text(errors="replace").lower()
            counts = {
                "slow_consumer": text.count("slow consumer"),
                "errors": text.count(" error ") + text.count("traceback"),
                "warnings": text.count(" warning "),
            }
            if any(counts.values()):
                out[name] = counts
        return out

    async def stop(self, names: list[str] | None = None) -> None:
        chosen = [self.named[n] for n in (names or list(self.named))]
        for proc in chosen:
            if proc.returncode is None:
                proc.send_signal(signal.SIGTERM)
        for proc in chosen:
            try:
                await asyncio.wait_for(proc.wait(), 30)
            except TimeoutError:
                proc.kill()


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of one process (0 when it is gone)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _postgres_pids(pgdata: Path) -> list[int]:
    try:
        master = int((pgdata / "postmaster.pid").read_text().split("\n", 1)[0])
    except (OSError, ValueError):
        return []
    pids = [master]
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError, IndexError, ValueError):
            if int(stat.read_text().rsplit(")", 1)[1].split()[1]) == master:
                pids.append(int(stat.parent.name))
    return pids


def _loadavg() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


# --- what holds the run back ------------------------------------------------------------------------------


@dataclass
class _Watch:
    """Every durable consumer's backlog (pending + unacknowledged) and every process's CPU seconds,
    sampled through the run."""

    t0: float
    cpu0: dict[str, float]
    samples: list[tuple[float, dict[str, int], dict[str, float]]] = field(default_factory=list)

    def sample(self, consumers: list[ConsumerInfo], cpu: dict[str, float]) -> None:
        self.samples.append((time.monotonic() - self.t0, {c.name: _backlog(c) for c in consumers}, cpu))

    def names(self) -> list[str]:
        return sorted({name for _, backlogs, _ in self.samples for name in backlogs})

    def consumer(self, name: str) -> dict[str, Any]:
        """Its backlog's max and its mean over the run's first and last thirds; growing when the last
        is over twice the first and over 100 messages."""
        backlog = [b.get(name, 0) for _, b, _ in self.samples] or [0]
        third = max(1, len(backlog) // 3)
        first, last = statistics.mean(backlog[:third]), statistics.mean(backlog[-third:])
        return {
            "max": max(backlog),
            "min": min(backlog),  # over 0: never caught up in the whole run
            "first_third": round(first),
            "last_third": round(last),
            "growing": last > max(2 * first, 100),
        }

    def timeline(self, every_s: float = 10.0) -> list[dict[str, Any]]:
        """About every `every_s`: the backlogs that are not empty, and each process's share of one core
        since the previous point."""
        out: list[dict[str, Any]] = []
        last_t, last_cpu = 0.0, self.cpu0
        for t, backlogs, cpu in self.samples:
            if t - last_t < every_s and (t, backlogs, cpu) != self.samples[-1]:
                continue
            span = max(t - last_t, 1e-9)
            out.append({
                "t": round(t, 1),
                "backlog": {k: v for k, v in backlogs.items() if v},
                "cpu": {k: round((v - last_cpu.get(k, 0.0)) / span, 2) for k, v in cpu.items()},
            })  # fmt: skip
            last_t, last_cpu = t, cpu
        return out


def _shares(cpu_s: dict[str, float], elapsed: float) -> dict[str, float]:
    """CPU seconds as a share of one core over the run (1.0: a process that had a core to itself)."""
    return {k: round(v / elapsed, 2) for k, v in sorted(cpu_s.items(), key=lambda kv: -kv[1])}


def _holding_back(
    plan: Plan,
    watch: _Watch,
    cpu_s: dict[str, float],
    elapsed: float,
    sims: list[dict[str, Any]],
    logs: dict[str, dict[str, int]],
    probes_missed: int,
    probe_ratio: float,
) -> list[str]:
    """What kept the run from its target, most telling first: the machine's cores, a process pegged at
    one core (a Python service uses one), consumers falling behind, a load generator late on its
    ticks, messages dropped by a slow subscriber, probes with no answer."""
    found = []
    cores = os.cpu_count() or 1
    busy = sum(cpu_s.values()) / (elapsed * cores)
    if busy >= 0.85:
        found.append(f"the machine: {busy:.0%} of its {cores} cores busy")
    for name, share in _shares(cpu_s, elapsed).items():
        if share >= 0.8 and name not in ("postgres", "nats-server"):  # those use several threads/processes
            found.append(f"{name}: {share:.0%} of a core (one Python process gets at most one)")
    for name in watch.names():
        c = watch.consumer(name)
        if c["growing"]:
            found.append(f"{name}: backlog growing, {c['first_third']} -> {c['last_third']} (max {c['max']})")
        elif c["min"]:
            found.append(f"{name}: never caught up, backlog {c['min']} to {c['max']}")
    for i, sim in enumerate(sims):
        if sim.get("p99_late_s", 0.0) > 0.5 / plan.step_hz:
            found.append(f"simulator-{i}: its ticks p99 {sim['p99_late_s']} s late (the generator is slow)")
    for name, counts in logs.items():
        if counts["slow_consumer"]:
            found.append(f"{name}: {counts['slow_consumer']} slow-consumer drops in its log")
    if probes_missed:
        found.append(f"guardian: {probes_missed} probes under load got no HaltJob within 30 s")
    if probe_ratio > 3:
        backlog = max(
            (watch.consumer(n)["max"] for n in watch.names() if n.startswith("guardian")), default=0
        )
        shares = {n: f"{v / elapsed:.0%}" for n, v in cpu_s.items() if n.startswith("guardian")}
        found.append(
            f"guardian: detect-to-command p99 {probe_ratio:.0f}x idle; "
            f"its share consumers' backlog max {backlog}; of a core each: {shares}"
        )
    return found


# --- the run ------------------------------------------------------------------------------------------------


async def _wait(check, timeout_s: float, what: str) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout_s
    while not await check():
        if time.monotonic() > deadline:
            raise TimeoutError(f"fleet bench: {what} not within {timeout_s}s")
        await asyncio.sleep(0.2)  # polling a condition


async def _count(http: httpx.AsyncClient, path: str, **params: Any) -> int:
    n, cursor = 0, None
    while True:
        page = (
            await http.get(path, params={**params, "limit": 1000, **({"cursor": cursor} if cursor else {})})
        ).json()
        n += len(page["items"])
        if not (cursor := page["next"]):
            return n


async def _fleet(plan: Plan, data: Path) -> dict[str, Any]:
    creds = credentials.load_or_create(data / credentials.CREDENTIALS_FILE)
    with (
        EmbeddedNats(data / "nats", users=creds.nats) as nats_server,
        EmbeddedPostgres(data / "postgres", password=creds.postgres, app_password=creds.postgres_app) as pg,
    ):
        pool = await create_pool(pg.url)
        await migrate(pool)
        bus = await Bus.connect(nats_server.url, "bench-fleet")
        await bus.ensure_streams()
        port = free_port()
        base_env = {
            **os.environ,
            "VIGIL_DATABASE_URL": pg.url,
            "VIGIL_DATA_DIR": str(data),
            "VIGIL_LOG_LEVEL": "WARNING",
            "VIGIL_WEBHOOK_URLS": "[]",
            "VIGIL_METRICS_PORT": "0",
            "VIGIL_API_TOKEN": TOKEN,
            "VIGIL_HTTP_PORT": str(port),
            "VIGIL_HEARTBEAT_INTERVAL_S": str(HEARTBEAT_S),
        }

        def env(role: str) -> dict[str, str]:
            return {**base_env, "VIGIL_NATS_URL": nats_server.url_for(role)}

        procs = _Procs(data / "logs")
        halts = _Halts()
        core = await bus.nc.subscribe(subjects.ALL_CMDS, cb=halts.on_msg)
        spec = JobSpec(name="probe", resources={"nodes": 1, "gpus_per_node": 1})
        try:
            await procs.start("scheduler", _SERVICE, "vigil_scheduler.main", env=env(credentials.SCHEDULER))
            for i in range(plan.telemetry):
                await procs.start(
                    f"telemetry-{i}", _SERVICE, "vigil_telemetry.main", env=env(credentials.TELEMETRY)
                )
            for i in range(plan.guardians):
                await procs.start(
                    f"guardian-{i}", _SERVICE, "vigil_guardian.main", env=env(credentials.GUARDIAN)
                )
            http = httpx.AsyncClient(
                base_url=f"http://127.0.0.1:{port}", headers={"Authorization": f"Bearer {TOKEN}"}, timeout=30
            )

            async def ready() -> bool:
                with contextlib.suppress(httpx.HTTPError):
                    return (await http.get("/readyz")).status_code == 200
                return False

            await _wait(ready, 120, "the scheduler ready")
            await _wait(
                lambda: _guardians_divided(pool, plan.guardians), 120, "the guardians sharing the jobs"
            )
            await _wait(lambda: _guardian_idle(bus), 120, "the guardians consuming")
            await _wait(
                lambda: _consumer_idle(bus, _steps_stream(), "telemetry-steps"), 120, "telemetry consuming"
            )

            # idle: the floor
            idle_load = _loadavg()
            idle_stages, load_stages = _Stages(), _Stages()
            idle = [await _probe(bus, halts, spec, idle_stages) for _ in range(IDLE_PROBES + 1)][
                1:
            ]  # 1st warms up

            # the fleet comes up: nodes heartbeat, one 8-device job per node is placed and launched
            per = math.ceil(plan.nodes / plan.simulators)
            sims = []
            for s in range(plan.simulators):
                first, count = s * per, min(per, plan.nodes - s * per)
                if count <= 0:
                    break
                sim = await procs.start(
                    f"simulator-{s}", _SIMULATOR, nats_server.url, str(first), str(count), str(plan.step_hz),
                    str(plan.seconds + 120), str(plan.phases), env=base_env, stdout=asyncio.subprocess.PIPE,
                )  # fmt: skip
                assert sim.stdout is not None
                await asyncio.wait_for(sim.stdout.readline(), 60)  # "ready"
                sims.append(f"simulator-{s}")

            await _wait(lambda: _nodes_alive(http, plan.nodes), 120, f"{plan.nodes} nodes registered")
            job_spec = {
                "name": "fleet",
                "resources": {"nodes": 1, "gpus_per_node": DEVICES},
                "guardian": {"hang_timeout_s": 600},
            }
            for _ in range(plan.nodes):
                r = await http.post("/api/v1/jobs", json=job_spec)
                r.raise_for_status()
            await _wait(lambda: _launched(http, plan.nodes), 300, f"{plan.nodes} jobs launched and started")

            # under load
            size0 = await pool.fetchval("SELECT pg_database_size(current_database())")
            rows0 = await pool.fetchval("SELECT count(*) FROM telemetry_steps")
            cpu0 = _cpu(procs, nats_server, pg)
            judged0 = await _judged_by_guardian(pool, bus)
            start_load = _loadavg()
            t_start = time.monotonic()
            loaded: list[float | None] = []
            watch = _Watch(t_start, cpu0)
            next_probe = t_start
            while time.monotonic() - t_start < plan.seconds:
                watch.sample(await _durables(bus), _cpu(procs, nats_server, pg))
                if time.monotonic() >= next_probe:
                    loaded.append(await _probe(bus, halts, spec, load_stages))
                    next_probe += PROBE_EVERY_S
                await asyncio.sleep(LAG_SAMPLE_S)  # the lag sampling period
            load_load = _loadavg()
            cpu1 = _cpu(procs, nats_server, pg)
            elapsed = time.monotonic() - t_start
            judged1 = await _judged_by_guardian(pool, bus)
            rows1 = await pool.fetchval("SELECT count(*) FROM telemetry_steps")
            await procs.stop(sims)
            sim_stats = []
            for name in sims:
                out = procs.named[name].stdout
                assert out is not None
                with contextlib.suppress(ValueError):
                    sim_stats.append(json.loads((await out.read()).decode().strip().splitlines()[-1]))
            drain_t = time.monotonic()
            await _wait(
                lambda: _consumer_idle(bus, _steps_stream(), "telemetry-steps"), 600, "telemetry drained"
            )
            drain_s = time.monotonic() - drain_t
            rows2 = await pool.fetchval("SELECT count(*) FROM telemetry_steps")
            size1 = await pool.fetchval("SELECT pg_database_size(current_database())")
            await http.aclose()
        finally:
            await core.unsubscribe()
            await procs.stop()
            await bus.close()
            await pool.close()

    ok_idle = [x for x in idle if x is not None]
    ok_load = [x for x in loaded if x is not None]
    idle_p99 = percentile(ok_idle, 0.99) if ok_idle else float("nan")
    load_p99 = percentile(ok_load, 0.99) if len(ok_load) == len(loaded) and ok_load else float("inf")
    rate = plan.target_rate
    tele = watch.consumer("telemetry-steps")
    lag_growing = tele["growing"] and tele["last_third"] > 2 * rate  # and more than two seconds of events
    published = sum(s.get("step", 0) for s in sim_stats)
    stored_during = rows1 - rows0
    cpu = {k: round(cpu1.get(k, 0.0) - cpu0.get(k, 0.0), 1) for k in cpu1}
    logs = procs.log_counts()
    ratio_ok = load_p99 <= 3 * idle_p99
    return result(
        "fleet",
        value=load_p99 * 1e3,
        floor=idle_p99 * 1e3,
        unit="ms, guardian p99 NaN step published -> HaltJob received, under load (floor: idle)",
        target="ratio <= 3, no telemetry lag growing, the step rate held",
        ok=bool(ratio_ok and not lag_growing and stored_during >= 0.9 * rate * elapsed),
        nodes=plan.nodes,
        ranks_per_node=DEVICES,
        step_hz=plan.step_hz,
        seconds=round(elapsed, 1),
        telemetry_replicas=plan.telemetry,
        guardians=plan.guardians,
        events_per_s_by_guardian={
            who: round((n - judged0.get(who, 0)) / elapsed, 1) for who, n in sorted(judged1.items())
        },
        phases=plan.phases,
        target_step_events_per_s=rate,
        published_step_events=published,  # over the simulators' whole run (start-up and drain included)
        stored_step_events_per_s=round(stored_during / elapsed, 1),
        telemetry_backlog_first_third=tele["first_third"],
        telemetry_backlog_last_third=tele["last_third"],
        telemetry_backlog_max=tele["max"],
        telemetry_lag_s_max=round(tele["max"] / rate, 2),
        guardian_backlog_max=sum(watch.consumer(c)["max"] for c in watch.names() if c.startswith("guardian")),
        lag_growing=lag_growing,
        telemetry_drain_after_s=round(drain_s, 2),
        stages_idle=idle_stages.summary(),
        stages_load=load_stages.summary(),
        guardian_idle_p50_ms=round(statistics.median(ok_idle) * 1e3, 2) if ok_idle else None,
        guardian_load_p50_ms=round(statistics.median(ok_load) * 1e3, 2) if ok_load else None,
        probes_idle=len(idle),
        probes_load=len(loaded),
        probes_load_missed=len(loaded) - len(ok_load),
        pg_mb_per_million_steps=round((size1 - size0) / max(rows2 - rows0, 1) * 1e6 / 2**20, 1),
        cpu_s_under_load=cpu,
        cpu_core_share=_shares(cpu, elapsed),
        consumers={c: watch.consumer(c) for c in watch.names()},
        holding_back=_holding_back(
            plan, watch, cpu, elapsed, sim_stats, logs, len(loaded) - len(ok_load), load_p99 / idle_p99
        ),
        logs=logs,
        timeline=watch.timeline(),
        simulators=sim_stats,
        loadavg_idle=idle_load,
        loadavg_load_start=start_load,
        loadavg_load_end=load_load,
        cores=os.cpu_count(),
    )


def _cpu(procs: _Procs, nats_server: EmbeddedNats, pg: EmbeddedPostgres) -> dict[str, float]:
    out = {name: cpu_seconds(p.pid) for name, p in procs.named.items()}
    if nats_server.proc is not None:
        out["nats-server"] = cpu_seconds(nats_server.proc.pid)
    out["postgres"] = sum(cpu_seconds(pid) for pid in _postgres_pids(pg.pgdata))
    out["bench"] = cpu_seconds(os.getpid())
    return out


async def _nodes_alive(http: httpx.AsyncClient, n: int) -> bool:
    return await _count(http, "/api/v1/nodes") >= n


async def _launched(http: httpx.AsyncClient, n: int) -> bool:
    """Every job's ranks started (a job the guardian has halted meanwhile counts: it did start)."""
    states = ("RUNNING", "HALTED", "ROLLING_BACK")
    return sum([await _count(http, "/api/v1/jobs", state=s) for s in states]) >= n


async def run(settings: Settings) -> dict[str, Any]:
    """The fleet always runs on its own embedded servers (with one NATS user per role)."""
    plan = Plan.from_env()
    with tempfile.TemporaryDirectory(prefix="vigil-fleet-") as tmp:
        return await _fleet(plan, Path(tmp))
