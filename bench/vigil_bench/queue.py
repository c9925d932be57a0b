"""`vigil bench queue`: the fair policy (priority, fair share, EASY backfill, preemption that loses no work)
against the strict one (priority then submission order, a blocked head holds up the queue), on one trace, in
the same run.

A seeded synthetic trace (`queue_trace`: Philly/Helios-shaped sizes and durations, three teams with their
own shares and priorities, bursts) is submitted through the gateway, each job by its team's user at its
arrival time, to two real scheduler processes at once, one with `VIGIL_QUEUE_POLICY=fair` and one with
`strict`, each on its own NATS and its own database of one embedded Postgres, each with its own simulated
cluster (`queue_sim`: `VIGIL_BENCH_QUEUE_NODES` nodes of 8 GPUs, default 64, that run what is launched and
honour `PreemptJob` by checkpointing). Time is compressed: a trace minute takes
`VIGIL_BENCH_QUEUE_SECONDS_PER_MINUTE` real seconds (default 2), and so do durations and time limits. Both
runs go on until every job has ended or `VIGIL_BENCH_QUEUE_DRAIN_MINUTES` (default: half the trace)
passed after the last arrival.

Other knobs: `VIGIL_BENCH_QUEUE_MINUTES` (arrivals span, default 60), `VIGIL_BENCH_QUEUE_LOAD` (offered
GPU-minutes over capacity, default 1.1), `VIGIL_BENCH_QUEUE_SEED` (0). Figures and targets: `queue_report`;
the last line is the JSON result, its `value` the fair policy's utilization and `floor` the strict one's.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from vigil_bench import result
from vigil_bench.elastic import fresh_database
from vigil_bench.queue_report import Outcome, figures, plot, print_table, targets
from vigil_bench.queue_sim import DEVICES, HEARTBEAT_S, Cluster, job_name
from vigil_bench.queue_trace import TEAMS, TraceJob, TraceShape, trace
from vigil_common.bus import Bus
from vigil_common.embedded import EmbeddedNats, EmbeddedPostgres, free_port
from vigil_common.settings import Settings

ADMIN_TOKEN = "bench-queue-admin-token-0123456789"
STEPS_PER_MINUTE = 20  # a simulated job reports 20 steps a trace minute
POLICIES = ("fair", "strict")


@dataclass(frozen=True, slots=True)
class Plan:
    nodes: int
    shape: TraceShape
    seconds_per_minute: float
    drain_minutes: float

    @classmethod
    def from_env(cls) -> Plan:
        env = os.environ.get
        nodes = int(env("VIGIL_BENCH_QUEUE_NODES", "64"))
        minutes = float(env("VIGIL_BENCH_QUEUE_MINUTES", "60"))
        shape = TraceShape(
            minutes=minutes,
            load=float(env("VIGIL_BENCH_QUEUE_LOAD", "1.1")),
            capacity=nodes * DEVICES,
            seed=int(env("VIGIL_BENCH_QUEUE_SEED", "0")),
            bursts=max(1, round(2 * minutes / 60)),
        )
        return cls(
            nodes=nodes,
            shape=shape,
            seconds_per_minute=float(env("VIGIL_BENCH_QUEUE_SECONDS_PER_MINUTE", "2")),
            drain_minutes=float(env("VIGIL_BENCH_QUEUE_DRAIN_MINUTES", str(minutes / 2))),
        )


def _token(team: str) -> str:
    return f"bench-queue-{team}-token-0123456789"


def _users_file(path: Path) -> Path:
    from vigil_scheduler.principals import token_sha256

    lines = ["teams:"] + [f"  - {{name: {t.name}, share: {t.share}}}" for t in TEAMS] + ["users:"]
    lines += [
        f"  - {{name: u-{t.name}, team: {t.name}, token_sha256: [{token_sha256(_token(t.name))}]}}"
        for t in TEAMS
    ]
    path.write_text("\n".join(lines) + "\n")
    return path


def _spec(job: TraceJob, seconds_per_minute: float) -> dict[str, Any]:
    nodes = max(1, job.gpus // DEVICES)
    return {
        "name": job_name(job),
        "priority": job.team.priority,
        "resources": {"nodes": nodes, "gpus_per_node": job.gpus // nodes},
        "scheduling": {"time_limit": max(1.0, round(job.limit * seconds_per_minute, 3))},
    }


class _Policy:
    """One policy's scheduler process, its bus and cluster, and the trace submitted to it."""

    def __init__(self, policy: str, plan: Plan, jobs: list[TraceJob], data: Path) -> None:
        self.policy, self.plan, self.jobs, self.data = policy, plan, jobs, data
        self.t0 = 0.0

    def now(self) -> float:
        return time.monotonic() - self.t0

    async def start(self, nats_url: str, database_url: str) -> None:
        self.data.mkdir(parents=True)
        self.port = free_port()
        env = {
            **os.environ,
            "VIGIL_NATS_URL": nats_url,
            "VIGIL_DATABASE_URL": database_url,
            "VIGIL_DATA_DIR": str(self.data),
            "VIGIL_HTTP_PORT": str(self.port),
            "VIGIL_API_TOKEN": ADMIN_TOKEN,
            "VIGIL_USERS_FILE": str(_users_file(self.data / "users.yaml")),
            "VIGIL_QUEUE_POLICY": self.policy,
            "VIGIL_PREEMPTION_GRACE_S": str(max(1.0, 5 * self.plan.seconds_per_minute)),
            "VIGIL_HEARTBEAT_INTERVAL_S": str(HEARTBEAT_S),
            "VIGIL_LOG_LEVEL": "WARNING",
            "VIGIL_METRICS_PORT": "0",
            "VIGIL_WEBHOOK_URLS": "[]",
        }
        code = (
            "from vigil_common.service import run_service; from vigil_common.settings import Settings; "
            "from vigil_scheduler.main import run; run_service(run, Settings.load())"
        )
        self.log = (self.data / "scheduler.log").open("wb")
        self.proc = await asyncio.create_subprocess_exec(sys.executable, "-c", code, env=env, stderr=self.log)
        self.bus = await Bus.connect(nats_url, f"bench-queue-{self.policy}")
        await self.bus.ensure_streams()
        self.http = httpx.AsyncClient(base_url=f"http://127.0.0.1:{self.port}", timeout=30)
        await self._until_ready()
        self.cluster = Cluster(
            self.bus, self.plan.nodes, self.plan.seconds_per_minute / STEPS_PER_MINUTE, self.now
        )
        await self.cluster.start()
        await self._until_nodes()

    async def _until_ready(self, timeout_s: float = 120.0) -> None:
        deadline = time.monotonic() + timeout_s
        while True:
            with contextlib.suppress(httpx.HTTPError):
                r = await self.http.get("/readyz")
                if r.status_code == 200 and r.json().get("role") == "active":
                    return
            if self.proc.returncode is not None or time.monotonic() > deadline:
                raise RuntimeError(f"queue bench: the {self.policy} scheduler not ready (see {self.data})")
            await asyncio.sleep(0.1)  # polling a readiness endpoint

    async def _until_nodes(self, timeout_s: float = 60.0) -> None:
        deadline = time.monotonic() + timeout_s
        auth = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
        while True:
            nodes = (await self.http.get("/api/v1/nodes", params={"limit": 1000}, headers=auth)).json()[
                "items"
            ]
            if sum(n["alive"] for n in nodes) >= self.plan.nodes:
                return
            if time.monotonic() > deadline:
                raise RuntimeError(f"queue bench: {self.plan.nodes} nodes not registered with {self.policy}")
            await asyncio.sleep(0.2)  # polling the inventory

    async def run(self, t0: float) -> Outcome:
        """Submit the trace from `t0` (monotonic) on; then wait for every job to end or the drain time."""
        self.t0, spm = t0, self.plan.seconds_per_minute
        for job in self.jobs:
            self.cluster.add(job, job.duration * spm)
        for job in self.jobs:
            record = self.cluster.records[job_name(job)]
            if (delay := job.arrival * spm - self.now()) > 0:
                await asyncio.sleep(delay)  # the trace's arrival time
            record.submitted = self.now()
            r = await self.http.post(
                "/api/v1/jobs",
                json=_spec(job, spm),
                headers={"Authorization": f"Bearer {_token(job.team.name)}"},
            )
            r.raise_for_status()
        window = self.plan.shape.minutes * spm
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(
                self.cluster.finished.wait(), max(0.0, window + self.plan.drain_minutes * spm - self.now())
            )
        ended = self.now()
        if self.cluster.errors:
            raise RuntimeError(
                f"queue bench ({self.policy}): the simulated cluster failed: {self.cluster.errors[:3]}"
            )
        return Outcome(
            self.policy, list(self.cluster.records.values()), window, ended, self.plan.nodes * DEVICES, spm
        )

    async def stop(self) -> None:
        with contextlib.suppress(Exception):
            await self.cluster.stop()
        with contextlib.suppress(Exception):
            await self.http.aclose()
        with contextlib.suppress(Exception):
            await self.bus.close()
        if self.proc.returncode is None:
            self.proc.terminate()
        try:
            await asyncio.wait_for(self.proc.wait(), 30)
        except TimeoutError:
            self.proc.kill()
            await self.proc.wait()
        self.log.close()


async def _bench(plan: Plan, data: Path, png: Path) -> dict[str, Any]:
    jobs = trace(plan.shape)
    took: dict[str, float] = {}
    t_start = time.monotonic()
    with contextlib.ExitStack() as stack:
        pg = stack.enter_context(EmbeddedPostgres(data / "postgres"))
        servers = {p: stack.enter_context(EmbeddedNats(data / f"nats-{p}")) for p in POLICIES}
        runs = {p: _Policy(p, plan, jobs, data / p) for p in POLICIES}
        try:
            for p in POLICIES:
                await runs[p].start(servers[p].url, await fresh_database(pg, f"queue_{p}"))
            took["start"] = round(time.monotonic() - t_start, 1)
            t0 = time.monotonic() + 0.5
            fair, strict = await asyncio.gather(*(runs[p].run(t0) for p in POLICIES))
            took["trace"] = round(time.monotonic() - t0, 1)
        finally:
            for p in POLICIES:
                if hasattr(runs[p], "proc"):
                    await runs[p].stop()
    f, s = figures(fair), figures(strict)
    checks = targets(f, s)
    print_table(f, s, checks)
    title = f"{len(jobs)} jobs over {plan.shape.minutes:g} trace minutes on {plan.nodes} x {DEVICES} GPUs"
    plot(png, [fair, strict], title)
    return result(
        "queue", f["utilization"], s["utilization"], "GPU utilization",
        "utilization >= strict + 0.10; small p95 wait <= 0.5x strict; largest job's wait <= 1.2x strict; "
        "fairness >= 0.9; 0 steps lost",
        utilization=f["utilization"], utilization_strict=s["utilization"],
        small_p95_wait_ratio=checks[1][1], largest_wait_ratio=checks[2][1],
        fairness=f["fairness"], fairness_strict=s["fairness"],
        preemptions=f["preemptions"], steps_lost=f["steps_lost"], png=str(png),
        ok=all(met for *_, met in checks),
        targets={name: met for name, _, _, met in checks},
        fair=f, strict=s,
        trace={"jobs": len(jobs), "minutes": plan.shape.minutes, "seed": plan.shape.seed,
               "load": plan.shape.load, "nodes": plan.nodes, "seconds_per_minute": plan.seconds_per_minute},
        took_s=took, loadavg=round(os.getloadavg()[0], 2),
    )  # fmt: skip


async def run(settings: Settings) -> dict[str, Any]:
    """Always on its own embedded servers (two NATS, one Postgres with a database per policy)."""
    plan = Plan.from_env()
    with tempfile.TemporaryDirectory(prefix="vigil-queue-") as tmp:
        return await _bench(plan, Path(tmp), (settings.data_dir / "bench" / "queue.png").resolve())
