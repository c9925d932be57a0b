"""`vigil bench fleet`: what each service costs per thousand ranks, and the guardian's latency at a load the
machine can carry.

Each service runs as its own process with its own NATS role (see `vigil_common.credentials`), on
embedded NATS and Postgres: the scheduler, `VIGIL_BENCH_FLEET_TELEMETRY` telemetry replicas (one
shared step consumer) and `VIGIL_BENCH_FLEET_GUARDIANS` guardians (dividing the jobs' shares).
Simulated nodes (`fleet_sim`: 8 devices each, one 8-device job per node placed through the gateway,
one step event per rank at `VIGIL_BENCH_FLEET_STEP_HZ`, a GPU sample per device every 5 s, a
heartbeat every 2 s) come up in steps, one simulator process per step, and each size is measured for
`VIGIL_BENCH_FLEET_SECONDS`:

1. idle: the guardian's detect-to-command p99 with no fleet (a probe job's NaN step published -> its
   HaltJob received): the floor;
2. each size of `VIGIL_BENCH_FLEET_SIZES` (nodes; default `16,48,auto`): every process's CPU seconds
   per second, probes once a second, every durable consumer's backlog. `auto` is the most nodes that
   keep `VIGIL_BENCH_FLEET_BUSY` (0.6) of the machine's cores busy, every process of the run counted
   (the simulator and the bench's own too), by the line through the sizes before it (at most 256);
   a size whose jobs do not all start within 300 s ends the growth, said in `grow_failed`;
3. with `VIGIL_BENCH_FLEET_STRESS=1`, 256 nodes x 8 ranks: a stress figure, reported with no target.

From the sizes: per service (nats-server, each guardian, telemetry, Postgres, the scheduler; the
simulator and the bench apart, they are not Vigil) a straight line of cores against ranks,
`per_1000_ranks` and `fixed` (`fleet_costs`), and the cores each needs at 1k, 10k and 100k GPUs at
one step per second, marked measured or extrapolated. The value is the detect-to-command p99 at the
largest size within about the busy share (10 % over it allowed: the size came from a fit), the floor
the idle p99; target: ratio <= 3 and no backlog growing there.

Measured beside each figure: the machine's load average and busy share (all of its processes: on a
shared machine others' work is in it), and the store's own latency (`stages`: a step's publish until
VIGIL_JOBS acknowledged it, an fsync per message). When the target is not met, `holding_back` says
why (`fleet_watch`; each process's stderr is read for slow-consumer drops). The phases' durations
are printed as they end and returned in `took_s`. The plan and a measured size are `fleet_plan`'s, the
result `fleet_report`'s.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import nats.errors

from vigil.jobstates import JobState
from vigil.spec import JobSpec
from vigil_bench.fleet_costs import costs, ranks_at_busy
from vigil_bench.fleet_plan import (
    AUTO,
    IDLE_PROBES,
    LAG_SAMPLE_S,
    PROBE_EVERY_S,
    SIMULATOR_S,
    STRESS_NODES,
    TOKEN,
    Plan,
    Window,
)
from vigil_bench.fleet_probes import (
    Halts,
    Stages,
    backlog,
    consumer_idle,
    durables,
    guardian_idle,
    guardians_divided,
    judged_by_guardian,
    probe,
    steps_stream,
)
from vigil_bench.fleet_procs import SERVICE, SIMULATOR, Procs, cpu, loadavg, machine_busy, machine_ticks
from vigil_bench.fleet_report import Took, report
from vigil_bench.fleet_sim import DEVICES, HEARTBEAT_S
from vigil_bench.fleet_watch import Watch
from vigil_common import credentials, subjects
from vigil_common.bus import Bus
from vigil_common.db import create_pool, migrate
from vigil_common.embedded import EmbeddedNats, EmbeddedPostgres, free_port
from vigil_common.settings import Settings

# --- the fleet ------------------------------------------------------------------------------------------


async def _until(check: Callable[[], Awaitable[bool]], timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while not await check():
        if time.monotonic() > deadline:
            return False
        await asyncio.sleep(0.2)  # polling a condition
    return True


async def _wait(check: Callable[[], Awaitable[bool]], timeout_s: float, what: str) -> None:
    if not await _until(check, timeout_s):
        raise TimeoutError(f"fleet bench: {what} not within {timeout_s}s")


async def _count(http: httpx.AsyncClient, path: str, **params: Any) -> int:
    n, cursor = 0, None
    while True:
        page = (
            await http.get(path, params={**params, "limit": 1000, **({"cursor": cursor} if cursor else {})})
        ).json()
        n += len(page["items"])
        if not (cursor := page["next"]):
            return n


@dataclass
class _Fleet:
    plan: Plan
    bus: Bus
    pool: Any
    http: httpx.AsyncClient
    procs: Procs
    halts: Halts
    nats_server: EmbeddedNats
    pg: EmbeddedPostgres
    env: dict[str, str]  # the simulators'
    probe_spec: JobSpec = field(
        default_factory=lambda: JobSpec(name="probe", resources={"nodes": 1, "gpus_per_node": 1})
    )
    nodes: int = 0
    sims: list[str] = field(default_factory=list)

    def cpu(self) -> dict[str, float]:
        return cpu(self.procs, self.nats_server, self.pg)

    async def grow(self, nodes: int) -> None:
        """Nodes [self.nodes, nodes) come up in a simulator of their own and heartbeat; one 8-device job
        each is submitted through the gateway, placed and started; then the consumers catch up."""
        name, first = f"simulator-{len(self.sims)}", self.nodes
        plan = self.plan
        sim = await self.procs.start(
            name, SIMULATOR, self.nats_server.url, str(first), str(nodes - first), str(plan.step_hz),
            str(SIMULATOR_S), str(plan.phases), env=self.env, stdout=asyncio.subprocess.PIPE,
        )  # fmt: skip
        assert sim.stdout is not None
        await asyncio.wait_for(sim.stdout.readline(), 60)  # "ready"
        self.sims.append(name)
        await _wait(lambda: self._registered(nodes), 120, f"{nodes} nodes registered")
        job = {
            "name": "fleet",
            "resources": {"nodes": 1, "gpus_per_node": DEVICES},
            "guardian": {"hang_timeout_s": 600},
        }
        for _ in range(nodes - first):
            (await self.http.post("/api/v1/jobs", json=job)).raise_for_status()
        if not await _until(lambda: self._launched(nodes), 300):
            states = {s: await _count(self.http, "/api/v1/jobs", state=s) for s in JobState}
            raise TimeoutError(
                f"fleet bench: {nodes} jobs launched and started not within 300s; jobs by state: {states}"
            )
        self.nodes = nodes
        # the launches' own work done: every backlog under one second of the fleet's steps (or 30 s
        # passed: a fleet the machine cannot carry never catches up, and that is what is measured)
        limit = nodes * DEVICES * plan.step_hz

        async def caught_up() -> bool:
            return all(backlog(c) <= limit for c in await durables(self.bus))

        await _until(caught_up, 30)

    async def _registered(self, n: int) -> bool:
        return await _count(self.http, "/api/v1/nodes") >= n

    async def _launched(self, n: int) -> bool:
        """Every job's ranks started (a job the guardian has halted meanwhile counts: it did start)."""
        states = ("RUNNING", "HALTED", "ROLLING_BACK")
        return sum([await _count(self.http, "/api/v1/jobs", state=s) for s in states]) >= n

    async def _judged(self) -> dict[str, tuple[int, int]]:
        """`judged_by_guardian`; empty when the server is too busy to answer."""
        with contextlib.suppress(nats.errors.TimeoutError):
            return await judged_by_guardian(self.pool, self.bus)
        return {}

    async def measure(self, seconds: float) -> Window:
        """`seconds` at the current size: CPU and backlogs every half second, a probe every second."""
        bus, pool = self.bus, self.pool
        size0 = await pool.fetchval("SELECT pg_database_size(current_database())")
        rows0 = await pool.fetchval("SELECT count(*) FROM telemetry_steps")
        judged0 = await self._judged()
        cpu0, ticks0 = self.cpu(), machine_ticks()
        t0 = time.monotonic()
        watch, stages, probes = Watch(t0, cpu0), Stages(), []
        next_probe = t0
        while time.monotonic() - t0 < seconds:
            with contextlib.suppress(nats.errors.TimeoutError):  # a server too busy to answer: no sample
                watch.sample(await durables(bus), self.cpu())
            if time.monotonic() >= next_probe:
                probes.append(await probe(bus, self.halts, self.probe_spec, stages))
                next_probe += PROBE_EVERY_S
            await asyncio.sleep(LAG_SAMPLE_S)  # the sampling period
        cpu1, ticks1 = self.cpu(), machine_ticks()
        elapsed = time.monotonic() - t0
        judged1 = await self._judged()
        rows1 = await pool.fetchval("SELECT count(*) FROM telemetry_steps")
        size1 = await pool.fetchval("SELECT pg_database_size(current_database())")
        return Window(
            nodes=self.nodes,
            step_hz=self.plan.step_hz,
            elapsed=elapsed,
            cpu_s={k: v - cpu0.get(k, 0.0) for k, v in cpu1.items()},
            watch=watch,
            probes=probes,
            stages=stages,
            stored=rows1 - rows0,
            db_bytes=size1 - size0,
            judged={who: n[0] - judged0[who][0] for who, n in sorted(judged1.items()) if who in judged0},
            offered={who: n[1] - judged0[who][1] for who, n in sorted(judged1.items()) if who in judged0},
            machine_busy=machine_busy(ticks0, ticks1),
            loadavg=loadavg(),
        )

    async def stop(self) -> tuple[list[dict[str, Any]], float | None]:
        """The simulators stopped (their own figures) and the seconds telemetry took to drain after
        (None: not within 120 s)."""
        await self.procs.stop(self.sims)
        stats = []
        for name in self.sims:
            out = self.procs.named[name].stdout
            assert out is not None
            with contextlib.suppress(ValueError, IndexError):
                stats.append(json.loads((await out.read()).decode().strip().splitlines()[-1]))
        t0 = time.monotonic()
        drained = await _until(lambda: consumer_idle(self.bus, steps_stream(), "telemetry-steps"), 120)
        return stats, time.monotonic() - t0 if drained else None


def _auto_nodes(plan: Plan, windows: list[Window], cores: int) -> int:
    """The most nodes that keep `plan.busy` of the cores busy by the line through `windows` (every process
    counted), at most the stress size."""
    total = costs([(w.ranks, w.cpu_per_s) for w in windows])["total"]
    return min(ranks_at_busy(total, cores, plan.busy) // DEVICES, STRESS_NODES)


async def _fleet(plan: Plan, data: Path) -> dict[str, Any]:
    took, cores = Took(), os.cpu_count() or 1
    creds = credentials.load_or_create(data / credentials.CREDENTIALS_FILE)
    with (
        EmbeddedNats(data / "nats", users=creds.nats) as nats_server,
        EmbeddedPostgres(data / "postgres", password=creds.postgres, app_password=creds.postgres_app) as pg,
    ):
        pool = await create_pool(pg.url)
        await migrate(pool)
        bus = await Bus.connect(nats_server.url, "bench-fleet")
        await bus.ensure_streams()
        took.s["start nats-server and postgres"] = round(time.monotonic() - took.t0, 1)
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

        procs = Procs(data / "logs")
        halts = Halts()
        core = await bus.nc.subscribe(subjects.ALL_CMDS, cb=halts.on_msg)
        http = httpx.AsyncClient(
            base_url=f"http://127.0.0.1:{port}", headers={"Authorization": f"Bearer {TOKEN}"}, timeout=30
        )
        try:
            with took("start the services"):
                await procs.start(
                    "scheduler", SERVICE, "vigil_scheduler.main", env=env(credentials.SCHEDULER)
                )
                for i in range(plan.telemetry):
                    await procs.start(
                        f"telemetry-{i}", SERVICE, "vigil_telemetry.main", env=env(credentials.TELEMETRY)
                    )
                for i in range(plan.guardians):
                    await procs.start(
                        f"guardian-{i}", SERVICE, "vigil_guardian.main", env=env(credentials.GUARDIAN)
                    )

                async def ready() -> bool:
                    with contextlib.suppress(httpx.HTTPError):
                        return (await http.get("/readyz")).status_code == 200
                    return False

                await _wait(ready, 120, "the scheduler ready")
                await _wait(
                    lambda: guardians_divided(pool, plan.guardians), 120, "the guardians sharing the jobs"
                )
                await _wait(lambda: guardian_idle(bus), 120, "the guardians consuming")
                await _wait(
                    lambda: consumer_idle(bus, steps_stream(), "telemetry-steps"), 120, "telemetry consuming"
                )
            fleet = _Fleet(plan, bus, pool, http, procs, halts, nats_server, pg, base_env)

            with took("idle probes"):
                idle_load, idle_stages = loadavg(), Stages()
                # the first warms up
                idle = [
                    await probe(bus, halts, fleet.probe_spec, idle_stages) for _ in range(IDLE_PROBES + 1)
                ]
                idle = idle[1:]

            windows: list[Window] = []
            failed: list[str] = []  # a size whose jobs did not all start: measured no further
            for size in plan.sizes:
                nodes = size if isinstance(size, int) else _auto_nodes(plan, windows, cores)
                if nodes <= fleet.nodes:  # auto: the machine is full at the sizes before it already
                    print(f"fleet: {AUTO} gives {nodes} nodes, not over {fleet.nodes}", file=sys.stderr)
                    continue
                try:
                    with took(f"grow to {nodes} nodes"):
                        await fleet.grow(nodes)
                except TimeoutError as exc:
                    failed.append(str(exc))
                    break
                with took(f"measure {nodes} nodes"):
                    windows.append(await fleet.measure(plan.seconds))
            if len(windows) < 2:
                raise RuntimeError(f"fleet bench: fewer than two sizes measured: {failed}")
            stress = None
            if plan.stress and not failed:
                if fleet.nodes < STRESS_NODES:
                    try:
                        with took(f"grow to {STRESS_NODES} nodes (stress)"):
                            await fleet.grow(STRESS_NODES)
                        with took(f"measure {STRESS_NODES} nodes (stress)"):
                            stress = await fleet.measure(plan.seconds)
                    except TimeoutError as exc:
                        failed.append(f"stress: {exc}")
                else:
                    stress = windows[-1]
            with took("stop the simulators, telemetry drains"):
                sim_stats, drain_s = await fleet.stop()
        finally:
            await http.aclose()
            await core.unsubscribe()
            await procs.stop()
            await bus.close()
            await pool.close()
    logs = procs.log_counts()
    return report(
        plan, cores, idle, idle_stages, idle_load, windows, stress, sim_stats, drain_s, logs, took, failed
    )


async def run(settings: Settings) -> dict[str, Any]:
    """The fleet always runs on its own embedded servers (with one NATS user per role)."""
    plan = Plan.from_env()
    with tempfile.TemporaryDirectory(prefix="vigil-fleet-") as tmp:
        return await _fleet(plan, Path(tmp))
