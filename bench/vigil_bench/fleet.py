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
are printed as they end and returned in `took_s`.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import nats.errors

from vigil.jobstates import JobState
from vigil.spec import JobSpec
from vigil_bench import percentile, result
from vigil_bench.fleet_costs import costs, ranks_at_busy, render, sizing
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
from vigil_bench.fleet_sim import DEVICES, HEARTBEAT_S
from vigil_bench.fleet_watch import Watch, holding_back, shares
from vigil_common import credentials, subjects
from vigil_common.bus import Bus
from vigil_common.db import create_pool, migrate
from vigil_common.embedded import EmbeddedNats, EmbeddedPostgres, free_port
from vigil_common.settings import Settings

PROBE_EVERY_S = 1.0
IDLE_PROBES = 60
LAG_SAMPLE_S = 0.5
TOKEN = "bench-fleet-token-" + "x" * 16
AUTO = "auto"
STRESS_NODES = 256
BUSY_SLACK = 1.1  # "at most about" the busy share: the auto size comes from a fit of noisy figures
SIMULATOR_S = 24 * 3600.0  # a simulator runs until the bench stops it


@dataclass(frozen=True)
class Plan:
    # Nodes at each measured size, increasing; `auto` (last only): the most that keep `busy` of the cores
    # busy, by the line through the sizes before it (two at least).
    sizes: tuple[int | str, ...] = (16, 48, AUTO)
    step_hz: float = 1.0
    seconds: float = 60.0  # measured at each size
    busy: float = 0.6
    stress: bool = False  # and 256 nodes after the sizes, reported with no target
    telemetry: int = 1
    guardians: int = 2
    # Each node steps at its own phase of the period, in this many groups (1: every rank of the fleet
    # at the same instant, a burst no real fleet of independent jobs sends).
    phases: int = 16

    def __post_init__(self) -> None:
        fixed = [s for s in self.sizes if s != AUTO]
        where = f"VIGIL_BENCH_FLEET_SIZES={','.join(map(str, self.sizes))}"
        if any(not isinstance(s, int) or s < 1 for s in fixed):
            raise ValueError(f"{where}: each size is a number of nodes (1 or more) or '{AUTO}'")
        if AUTO in self.sizes[:-1]:
            raise ValueError(f"{where}: '{AUTO}' can only be the last size")
        if fixed != sorted(set(fixed)):
            raise ValueError(f"{where}: the sizes must increase (the fleet only grows)")
        if len(fixed) < 2:
            raise ValueError(f"{where}: two sizes at least are measured before a cost line can be drawn")
        if not 0 < self.busy <= 1:
            raise ValueError(f"VIGIL_BENCH_FLEET_BUSY={self.busy}: a share of the cores, in (0, 1]")

    @classmethod
    def from_env(cls) -> Plan:
        env = os.environ.get
        for gone, instead in (("NODES", "SIZES"), ("SIMULATORS", "SIZES (one simulator per size)")):
            if env(f"VIGIL_BENCH_FLEET_{gone}"):
                raise ValueError(f"VIGIL_BENCH_FLEET_{gone} is gone: set VIGIL_BENCH_FLEET_{instead}")
        raw = env("VIGIL_BENCH_FLEET_SIZES", ",".join(map(str, cls.sizes)))
        try:
            sizes = tuple(s if s == AUTO else int(s) for s in (p.strip() for p in raw.split(",")))
        except ValueError:
            raise ValueError(
                f"VIGIL_BENCH_FLEET_SIZES={raw}: comma-separated node counts, the last may be '{AUTO}'"
            ) from None
        stress = env("VIGIL_BENCH_FLEET_STRESS", "0")
        if stress not in ("0", "1"):
            raise ValueError(f"VIGIL_BENCH_FLEET_STRESS={stress}: 1 (also the 256-node stress run) or 0")
        return cls(
            sizes=sizes,
            step_hz=float(env("VIGIL_BENCH_FLEET_STEP_HZ", cls.step_hz)),
            seconds=float(env("VIGIL_BENCH_FLEET_SECONDS", cls.seconds)),
            busy=float(env("VIGIL_BENCH_FLEET_BUSY", cls.busy)),
            stress=stress == "1",
            telemetry=int(env("VIGIL_BENCH_FLEET_TELEMETRY", cls.telemetry)),
            guardians=int(env("VIGIL_BENCH_FLEET_GUARDIANS", cls.guardians)),
            phases=int(env("VIGIL_BENCH_FLEET_PHASES", cls.phases)),
        )


# --- one measured size ----------------------------------------------------------------------------------


@dataclass
class Window:
    """A stretch of `elapsed` seconds at `nodes` nodes: every process's CPU, the probes, the backlogs."""

    nodes: int
    step_hz: float
    elapsed: float
    cpu_s: dict[str, float]  # per process, over the window
    watch: Watch
    probes: list[float | None]
    stages: Stages
    stored: int  # step rows telemetry stored meanwhile
    db_bytes: int  # the database's growth meanwhile
    judged: dict[str, int]  # per guardian, the events it acknowledged meanwhile
    offered: dict[str, int]  # per guardian, the events its shares' consumers were offered meanwhile
    machine_busy: float  # every process on the machine, ours or not
    loadavg: list[float]  # at its end

    @property
    def ranks(self) -> int:
        return self.nodes * DEVICES

    @property
    def rate(self) -> float:
        return self.ranks * self.step_hz

    @property
    def cpu_per_s(self) -> dict[str, float]:
        return {k: v / self.elapsed for k, v in self.cpu_s.items()}

    def busy(self, cores: int) -> float:
        """The share of the machine's cores this run's processes kept busy (simulator and bench too)."""
        return sum(self.cpu_s.values()) / (self.elapsed * cores)

    @property
    def answered(self) -> list[float]:
        return [x for x in self.probes if x is not None]

    @property
    def p99(self) -> float:
        """Seconds; infinite when a probe got no answer."""
        ok = self.answered
        return percentile(ok, 0.99) if ok and len(ok) == len(self.probes) else math.inf

    def growing(self) -> list[str]:
        """The durable consumers whose backlog grew through the window: its last third over twice its
        first (`Watch.consumer`) and over one second of the fleet's step events."""
        return [
            name
            for name in self.watch.names()
            if (c := self.watch.consumer(name))["growing"] and c["last_third"] > self.rate
        ]

    @property
    def rate_held(self) -> bool:
        return self.stored >= 0.9 * self.rate * self.elapsed

    def summary(self, idle_p99: float, cores: int) -> dict[str, Any]:
        p99 = self.p99
        return {
            "nodes": self.nodes,
            "ranks": self.ranks,
            "seconds": round(self.elapsed, 1),
            "busy": round(self.busy(cores), 3),
            "machine_busy": round(self.machine_busy, 3),
            "cpu_per_s": {k: round(v, 4) for k, v in sorted(self.cpu_per_s.items())},
            "p50_ms": round(statistics.median(self.answered) * 1e3, 2) if self.answered else None,
            "p99_ms": round(p99 * 1e3, 2) if math.isfinite(p99) else None,
            "ratio": round(p99 / idle_p99, 2) if math.isfinite(p99) else None,
            "probes": len(self.probes),
            "probes_missed": len(self.probes) - len(self.answered),
            "backlog_growing": self.growing(),
            "target_step_events_per_s": self.rate,
            "stored_step_events_per_s": round(self.stored / self.elapsed, 1),
            "loadavg": self.loadavg,
            "stages": self.stages.summary(),
        }


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


class _Took:
    """Each phase's wall time, printed to stderr as it ends."""

    def __init__(self) -> None:
        self.s: dict[str, float] = {}
        self.t0 = time.monotonic()

    @contextlib.contextmanager
    def __call__(self, phase: str) -> Iterator[None]:
        t0 = time.monotonic()
        try:
            yield
        finally:
            self.s[phase] = round(time.monotonic() - t0, 1)
            print(f"fleet: {phase}: {self.s[phase]} s", file=sys.stderr, flush=True)


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
    took, cores = _Took(), os.cpu_count() or 1
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
    return _report(
        plan, cores, idle, idle_stages, idle_load, windows, stress, sim_stats, drain_s, logs, took, failed
    )


def _report(
    plan: Plan,
    cores: int,
    idle: list[float | None],
    idle_stages: Stages,
    idle_load: list[float],
    windows: list[Window],
    stress: Window | None,
    sim_stats: list[dict[str, Any]],
    drain_s: float | None,
    logs: dict[str, dict[str, int]],
    took: _Took,
    failed: list[str],
) -> dict[str, Any]:
    ok_idle = [x for x in idle if x is not None]
    idle_p99 = percentile(ok_idle, 0.99) if ok_idle else math.nan
    fits = costs([(w.ranks, w.cpu_per_s) for w in windows])  # the stress run is not in the lines
    within = [w for w in windows if w.busy(cores) <= plan.busy * BUSY_SLACK]
    at = within[-1] if within else windows[0]  # the latency figure's size
    sizes = [w.summary(idle_p99, cores) for w in windows]
    table = sizing(fits)
    print(render(sizes, fits, table), flush=True)
    load_p99 = at.p99
    print(
        f"\nlatency at {at.ranks} ranks ({at.busy(cores):.0%} of {cores} cores busy by this run, "
        f"{at.machine_busy:.0%} by everything): p99 {load_p99 * 1e3:.1f} ms vs {idle_p99 * 1e3:.1f} ms "
        f"idle, ratio {load_p99 / idle_p99:.2f}; backlog growing: {', '.join(at.growing()) or 'none'}",
        flush=True,
    )
    stress_out = None
    if stress is not None:
        # and what the lines through the sizes said it would cost: how far they hold beyond them
        predicted = fits["total"].at(stress.ranks) / cores
        stress_out = {
            **stress.summary(idle_p99, cores),
            "busy_by_the_lines": round(predicted, 3),
            "target": None,
        }
        print(f"stress (no target): {json.dumps(stress_out)}", flush=True)
    took_s = {**took.s, "total": round(time.monotonic() - took.t0, 1)}
    print("took: " + ", ".join(f"{k} {v} s" for k, v in took_s.items()), flush=True)

    tele = at.watch.consumer("telemetry-steps")
    growing = at.growing()
    ok = (
        load_p99 <= 3 * idle_p99 and not growing and at.rate_held and at.busy(cores) <= plan.busy * BUSY_SLACK
    )

    held_back = holding_back(
        plan.step_hz, at.watch, at.cpu_s, at.elapsed, sim_stats, logs,
        len(at.probes) - len(at.answered), load_p99 / idle_p99, at.machine_busy,
    )  # fmt: skip
    store_p99 = percentile(at.stages.stored, 0.99) if at.stages.stored else 0.0
    if store_p99 > 0.1:
        held_back.insert(
            0,
            f"VIGIL_JOBS: a step's publish acknowledged p99 {store_p99 * 1e3:.0f} ms (an fsync per message): "
            "the stream is not keeping up",
        )
    held_back[:0] = [f"not measured: {f}" for f in failed]
    if not within:
        held_back.insert(
            0,
            f"no size kept {plan.busy:.0%} of the {cores} cores busy or less: the smallest, {at.ranks} "
            f"ranks, kept {at.busy(cores):.0%}",
        )

    def cost(name: str) -> dict[str, Any] | None:
        return fits[name].summary() if name in fits else None

    return result(
        "fleet",
        value=load_p99 * 1e3,
        floor=idle_p99 * 1e3,
        unit="ms, guardian p99 NaN step published -> HaltJob received, at the sustainable load (floor: idle)",
        target=f"ratio <= 3 and no backlog growing at the largest size keeping <= {plan.busy:.0%} of the "
        "cores busy (every process of the run counted), the step rate held",
        ok=bool(ok),
        nodes=at.nodes,
        ranks=at.ranks,
        ranks_per_node=DEVICES,
        step_hz=plan.step_hz,
        seconds=round(at.elapsed, 1),
        busy=round(at.busy(cores), 3),
        busy_target=plan.busy,
        machine_busy=round(at.machine_busy, 3),
        sustainable_ranks=ranks_at_busy(fits["total"], cores, plan.busy),
        backlog_growing=growing,
        sizes=sizes,
        costs={
            name: fits[name].summary() for name in sorted(fits) if name not in ("simulator", "bench", "total")
        },
        simulator_cost=cost("simulator"),
        bench_cost=cost("bench"),
        total_cost=cost("total"),
        sizing=table,
        sizing_note="cores = fixed + per_1000_ranks x GPUs / 1000, one rank per GPU at the step rate, "
        "along the line through the measured sizes: 'measured' inside their ranks, 'extrapolated' beyond",
        stress=stress_out,
        grow_failed=failed,
        telemetry_replicas=plan.telemetry,
        guardians=plan.guardians,
        events_per_s_by_guardian={who: round(n / at.elapsed, 1) for who, n in at.judged.items()},
        offered_per_s_by_guardian={who: round(n / at.elapsed, 1) for who, n in at.offered.items()},
        phases=plan.phases,
        target_step_events_per_s=at.rate,
        published_step_events=sum(s.get("step", 0) for s in sim_stats),  # the simulators' whole run
        stored_step_events_per_s=round(at.stored / at.elapsed, 1),
        telemetry_backlog_first_third=tele["first_third"],
        telemetry_backlog_last_third=tele["last_third"],
        telemetry_backlog_max=tele["max"],
        telemetry_lag_s_max=round(tele["max"] / at.rate, 2),
        guardian_backlog_max=sum(
            at.watch.consumer(c)["max"] for c in at.watch.names() if c.startswith("guardian")
        ),
        lag_growing="telemetry-steps" in growing,
        telemetry_drain_after_s=round(drain_s, 2) if drain_s is not None else None,
        stages_idle=idle_stages.summary(),
        stages_load=at.stages.summary(),
        guardian_idle_p50_ms=round(statistics.median(ok_idle) * 1e3, 2) if ok_idle else None,
        guardian_load_p50_ms=round(statistics.median(at.answered) * 1e3, 2) if at.answered else None,
        probes_idle=len(idle),
        probes_load=len(at.probes),
        probes_load_missed=len(at.probes) - len(at.answered),
        pg_mb_per_million_steps=round(at.db_bytes / max(at.stored, 1) * 1e6 / 2**20, 1),
        cpu_s_under_load={k: round(v, 1) for k, v in at.cpu_s.items()},
        cpu_core_share=shares(at.cpu_s, at.elapsed),
        consumers={c: at.watch.consumer(c) for c in at.watch.names()},
        holding_back=held_back,
        logs=logs,
        timeline=at.watch.timeline(),
        simulators=sim_stats,
        loadavg_idle=idle_load,
        loadavg_load_end=at.loadavg,
        cores=cores,
        took_s=took_s,
    )


async def run(settings: Settings) -> dict[str, Any]:
    """The fleet always runs on its own embedded servers (with one NATS user per role)."""
    plan = Plan.from_env()
    with tempfile.TemporaryDirectory(prefix="vigil-fleet-") as tmp:
        return await _fleet(plan, Path(tmp))
