"""`vigil bench elastic`: what losing a host mid-run costs a job, on each of Vigil's recovery paths.

Three hosts made of network namespaces (`netns.Network`: hosta, hostb, hostc), as the `multihost` tests
make them: one `vigil worker` per host in its namespace (`hosts.Workers`), NATS listening on the bridge's
address, the control plane (scheduler and gateway, telemetry, guardian) in this process on an embedded
Postgres. Each path gets a control plane of its own (a fresh NATS and database, the path's settings) and
fresh workers; on it, after a short warm-up job, the same 2-node job runs twice, one run after the other:
fault-free (the floor), then with host b killed (its worker and ranks SIGKILLed: the machine dies) once
it has reported step `kill_at`. The paths, all in one run of the bench:

- spare: `VIGIL_HOT_SPARES=1` and workers on all three hosts (hostc held in reserve). The lost ranks start
  again on the spare; the survivors keep their processes (in-job restart).
- elastic: spec `resources.elastic: {min_nodes: 1}`, workers on hosta and hostb only. The job goes on
  with hosta alone, the global batch kept by more micro-steps.
- requeue: neither (what Vigil did before hot spares and elastic jobs): the job waits for a whole node.
  Capacity frees `requeue_after_s` (T, default 5 s) after the kill, when a worker is started on hostc; its
  start, registration and warm ranks are part of what the path costs, as when a machine comes back.

Per path, from the job's own events (their `occurred_at`: this machine's clock, as is the kill's time):

- `detect_s`: the kill -> the job's move to PENDING whose cause names the lost node (the scheduler knows
  and acts); `incident_s`: the kill -> the node_lost incident.
- `first_step_s`: the kill -> the first step completed by an attempt after the first (its first
  StepCompleted).
- `steps_redone`: the last step attempt 1 completed + 1 - the first step of the next attempt.
- details: `step_s` (median step time before the kill and after the relaunch) and `phases` (per run,
  submission -> first step, first -> last step, last step -> the end) say where the rest of the time went.
- `goodput`: fault-free wall time / faulted wall time, each from the job's submission to SUCCEEDED, as
  `vigil bench goodput` defines it: both runs do the same useful steps, so this is the time those steps
  need over the wall time the faulted run took. Both runs start with every worker's warm ranks ready. A
  shrunk job's steps count as useful; their being slower (one host doing both hosts' micro-steps) is part
  of what the elastic path costs.

Targets on this machine (issue 40 §5): spare, first step <= 2 s after the kill plus the steps redone (at
the fault-free run's median step time) and goodput >= 0.95; elastic, first step <= 3 s. The requeue path
has none: it is there to compare (it costs at least T). `ratio` is the spare path's goodput (the floor,
the fault-free run's, is 1 by definition).

Size: 2 ranks (1 per host, `gpus_per_node: 1`), not the issue's 4 (2 per host). This machine has 2 CPU
cores, shared: 4 gloo ranks, with the warm ranks a worker keeps per slot (2 per host) that import torch and
DeepSpeed again at each refill, oversubscribe them. Measured here (30 steps, spare path): at 4 ranks the
median step is 0.50 s before the kill and 0.78 s after (0.13 s at 2 ranks), the guardian raises imbalance
alerts on whichever rank the cores left behind, and the first step comes 4.0 s after the kill (1.1 s at 2
ranks): the cores' scheduling, not Vigil, would set the figures. `measure(..., ranks_per_host=2)` runs the
issue's 4-rank job where there are cores for it.
"""

from __future__ import annotations

import asyncio
import contextlib
import statistics
import tempfile
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import asyncpg
import httpx

from vigil import events as ev
from vigil_bench import result
from vigil_bench.hosts import HostWorker, Workers, cannot_make_hosts
from vigil_bench.netns import Host, Network, remove_leftovers
from vigil_cli.stack import SERVICES, run_services
from vigil_common import subjects
from vigil_common.bus import Bus
from vigil_common.credentials import APP_ROLE
from vigil_common.db import create_pool, migrate
from vigil_common.embedded import EmbeddedNats, EmbeddedPostgres, free_port
from vigil_common.settings import Settings

PATHS = ("spare", "elastic", "requeue")
TOKEN = "bench-elastic-" + uuid.uuid4().hex
# Silence ends a node after 20 heartbeats (10 s), as in the multihost tests: a killed host is known sooner
# from stronger evidence (its worker's closed connection, the survivors' failed collective).
PLANE = {"heartbeat_interval_s": 0.5, "node_lost_after": 20}
SPARE_FIRST_STEP_S, SPARE_GOODPUT, ELASTIC_FIRST_STEP_S = 2.0, 0.95, 3.0
WARM_READY = "warm rank(s) ready"


def spec(name: str, *, steps: int, ranks_per_host: int, elastic: bool) -> dict[str, Any]:
    resources: dict[str, Any] = {"nodes": 2, "gpus_per_node": ranks_per_host}
    if elastic:
        resources["elastic"] = {"min_nodes": 1}
    return {
        "name": name,
        "resources": resources,
        "model": {"preset": "tiny", "n_layer": 2, "seq_len": 32},
        "train": {"steps": steps, "micro_batch": 4, "lr": 3e-3, "warmup_steps": 1, "zero_stage": 1},
        "checkpoint": {"every": 100, "keep": 2, "memory_every": 1},
    }


@dataclass
class Run:
    """One job's events, as the bench's watch heard them, and its wall time (submission to its end)."""

    job_id: str = ""
    wall_s: float = 0.0
    events: list[ev.Message] = field(default_factory=list)

    def of(self, cls: type[ev.Message]) -> list[Any]:
        return [e for e in self.events if isinstance(e, cls) and e.job_id == self.job_id]


@dataclass
class Plane:
    """One path's control plane in this process, and its workers in the hosts."""

    settings: Settings
    http: httpx.AsyncClient
    bus: Bus
    workers: Workers

    async def alive(self) -> tuple[set[str], set[str]]:
        items = (await self.http.get("/api/v1/nodes", params={"limit": 500})).json()["items"]
        return {n["name"] for n in items if n["alive"]}, {n["name"] for n in items if n.get("spare")}


async def until(check: Callable[[], Awaitable[bool]], timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not await check():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what}: not within {timeout_s:.0f}s")
        await asyncio.sleep(0.2)


async def fresh_database(server: EmbeddedPostgres, name: str) -> str:
    """A new, migrated database on `server`, owned by the services' role."""
    conn = await asyncpg.connect(server.admin_url)
    try:
        await conn.execute(f'CREATE DATABASE "{name}" OWNER "{APP_ROLE}"')
    finally:
        await conn.close()
    url = urlunsplit(urlsplit(server.url)._replace(path="/" + name))
    pool = await create_pool(url)
    try:
        await migrate(pool)
    finally:
        await pool.close()
    return url


@contextlib.asynccontextmanager
async def plane(
    base: Settings, network: Network, postgres: EmbeddedPostgres, folder: Path, **settings: Any
) -> AsyncIterator[Plane]:
    """Scheduler and gateway, telemetry and guardian in this process, on a NATS of their own on the bridge
    (the hosts reach it) and a fresh database; the workers started on it are stopped on the way out, and
    whatever is left in the hosts is killed."""
    with EmbeddedNats(folder / "nats", host=network.gateway) as nats:
        config = base.model_copy(
            update={
                "nats_url": nats.url,
                "database_url": await fresh_database(postgres, "bench_" + folder.name),
                "data_dir": folder,
                "http_host": network.gateway,
                "http_port": free_port(network.gateway),
                "api_token": TOKEN,
                "metrics_port": 0,
                **PLANE,
                **settings,
            }
        )
        stop = asyncio.Event()
        services = asyncio.create_task(run_services(config, stop, SERVICES[:3]))
        bus = await Bus.connect(nats.url, "bench-elastic")
        http = httpx.AsyncClient(
            base_url=f"http://{config.http_host}:{config.http_port}",
            headers={"Authorization": f"Bearer {TOKEN}"},
            timeout=10,
        )
        workers = Workers(nats.url, folder / "shared")
        workers.data_dir.mkdir(parents=True)
        try:

            async def ready() -> bool:
                if services.done():
                    services.result()
                with contextlib.suppress(httpx.HTTPError):
                    r = await http.get("/readyz")
                    return r.status_code == 200 and r.json().get("role") == "active"
                return False

            await until(ready, 60, "the control plane ready")
            yield Plane(config, http, bus, workers)
        finally:
            await asyncio.to_thread(workers.stop)
            for host in network.hosts:
                host.kill_all()
            stop.set()
            await asyncio.wait_for(services, 60)
            await http.aclose()
            await bus.close()


def warm_count(worker: HostWorker) -> int:
    return worker.log.read_text(errors="replace").count(WARM_READY)


async def warm_again(workers: list[HostWorker], marks: dict[str, int]) -> None:
    """Until each worker has said its warm ranks are all ready more often than `marks` (by node) says."""

    async def ready() -> bool:
        dead = [w for w in workers if w.proc.poll() is not None]
        if dead:
            raise RuntimeError(f"worker {dead[0].node} exited {dead[0].proc.returncode}")
        return all(warm_count(w) > marks.get(w.node, 0) for w in workers)

    await until(ready, 180, "the workers' warm ranks ready")


async def train(
    p: Plane, body: dict[str, Any], *, timeout_s: float, fault: Callable[[Run], Awaitable[None]] | None = None
) -> Run:
    """Submit `body` and wait for its end; `fault(run)` is awaited beside, for a faulted run."""
    run, ended = Run(), asyncio.Event()
    watched = (subjects.ALL_LAUNCHES, subjects.ALL_STEPS, subjects.ALL_STATUS, subjects.ALL_INCIDENTS)
    async with p.bus.watch(*watched) as events:

        async def collect() -> None:
            async for e in events:
                run.events.append(e)
                if (
                    isinstance(e, ev.JobStateChanged)
                    and e.job_id == run.job_id
                    and e.to_state in ev.TERMINAL_STATES
                ):
                    ended.set()

        collector = asyncio.create_task(collect())
        t0 = time.perf_counter()
        try:
            response = await p.http.post("/api/v1/jobs", json=body)
            response.raise_for_status()
            run.job_id = response.json()["id"]
            if fault is not None:
                await asyncio.wait_for(fault(run), timeout_s)
            await asyncio.wait_for(ended.wait(), timeout_s)
        finally:
            run.wall_s = time.perf_counter() - t0
            collector.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await collector
    state = run.of(ev.JobStateChanged)[-1].to_state
    if state != "SUCCEEDED":
        raise RuntimeError(f"bench job {run.job_id} ended {state}\n{p.workers.logs()}")
    return run


def costs(clean: Run, faulted: Run, killed: float, node: str) -> dict[str, Any]:
    """What the kill cost the faulted run (see the module's docstring)."""
    steps = faulted.of(ev.StepCompleted)
    last1 = max(e.step for e in steps if e.attempt == 1)
    after = [e for e in steps if e.attempt > 1]
    first2 = min(e.step for e in after)
    lost = [
        e.occurred_at.timestamp()
        for e in faulted.of(ev.JobStateChanged)
        if e.to_state == "PENDING" and e.cause.startswith(f"node {node} lost")
    ]
    incidents = [e.occurred_at.timestamp() for e in faulted.of(ev.IncidentRaised) if e.kind == "node_lost"]
    relaunch = [e for e in faulted.of(ev.LaunchJob) if e.attempt > 1]
    return {
        "detect_s": round(min(lost) - killed, 3) if lost else None,
        "incident_s": round(min(incidents) - killed, 3) if incidents else None,
        "first_step_s": round(min(e.occurred_at.timestamp() for e in after) - killed, 3),
        "steps_redone": max(0, last1 + 1 - first2),
        "goodput": round(clean.wall_s / faulted.wall_s, 4),
        "fault_free_s": round(clean.wall_s, 3),
        "faulted_s": round(faulted.wall_s, 3),
        "killed_after_step": last1,
        "step_s": {  # the median step time before the kill and after the relaunch
            "before": round(statistics.median(e.step_time_s for e in steps if e.attempt == 1), 4),
            "after": round(statistics.median(e.step_time_s for e in after), 4),
        },
        "phases": {name: phases(r) for name, r in (("fault_free", clean), ("faulted", faulted))},
        "attempts": max(e.attempt for e in faulted.of(ev.LaunchJob)),
        # more than 1: the fault-free run failed on its own (a loaded machine) and its figure is not a floor
        "fault_free_attempts": max(e.attempt for e in clean.of(ev.LaunchJob)),
        "placed_on": sorted({p.node for p in relaunch[0].placement}) if relaunch else [],
        "ranks_after": relaunch[0].world_size if relaunch else None,
    }


def phases(run: Run) -> dict[str, float]:
    """Where a run's wall time went: submission -> first step, first -> last step, last step -> its end."""
    submitted = min(e.occurred_at.timestamp() for e in run.of(ev.JobStateChanged))
    steps = [e.occurred_at.timestamp() for e in run.of(ev.StepCompleted)]
    end = run.of(ev.JobStateChanged)[-1].occurred_at.timestamp()
    return {
        "start_s": round(min(steps) - submitted, 3),
        "train_s": round(max(steps) - min(steps), 3),
        "end_s": round(end - max(steps), 3),
    }


async def one_path(
    path: str,
    base: Settings,
    network: Network,
    postgres: EmbeddedPostgres,
    root: Path,
    *,
    steps: int,
    kill_at: int,
    ranks_per_host: int,
    requeue_after_s: float,
    warmup_steps: int,
) -> dict[str, Any]:
    a, b, c = network.hosts
    extra = {"hot_spares": 1} if path == "spare" else {}
    async with plane(base, network, postgres, root / path, **extra) as p:
        hosts: list[Host] = [a, b, c] if path == "spare" else [a, b]
        # node names of this run's own: /dev/shm/vigil-<node> (snapshots) is the machine's, shared by every
        # namespace host, and another run's hostb (a test's, or this run's path before) must not touch ours
        tag = uuid.uuid4().hex[:6]
        started = [p.workers.start(h, slots=ranks_per_host, node=f"{h.hostname}-{tag}") for h in hosts]

        async def registered() -> bool:
            alive, spares = await p.alive()
            return alive == {w.node for w in started} and (path != "spare" or spares == {started[2].node})

        await until(registered, 90, f"{path}: workers alive")
        await warm_again(started, {})
        body = spec(
            f"bench-elastic-{path}", steps=steps, ranks_per_host=ranks_per_host, elastic=path == "elastic"
        )
        placed = started[:2]
        if warmup_steps:  # first-run costs (page cache, the first checkpoint folder) go here
            marks = {w.node: warm_count(w) for w in placed}
            await train(p, {**body, "train": {**body["train"], "steps": warmup_steps}}, timeout_s=300)
            await warm_again(placed, marks)
        marks = {w.node: warm_count(w) for w in placed}
        clean = await train(p, body, timeout_s=600)
        await warm_again(placed, marks)

        killed = 0.0

        async def kill_host_b(run: Run) -> None:
            nonlocal killed
            node = started[1].node
            await until(lambda: _reached(run, node, kill_at), 300, f"{path}: step {kill_at} on {node}")
            p.workers.kill(b)
            killed = time.time()
            if path == "requeue":  # capacity frees T s after the kill: a worker on hostc
                await asyncio.sleep(requeue_after_s)
                p.workers.start(c, slots=ranks_per_host, node=f"{c.hostname}-{tag}")

        faulted = await train(p, body, timeout_s=600, fault=kill_host_b)
        out = costs(clean, faulted, killed, started[1].node)
        out["median_step_s"] = round(
            statistics.median(e.step_time_s for e in clean.of(ev.StepCompleted) if e.rank == 0), 4
        )
        return out


async def _reached(run: Run, node: str, step: int) -> bool:
    return any(e.step >= step for e in run.of(ev.StepCompleted) if e.node == node)


def judge(path: str, row: dict[str, Any]) -> None:
    """Each path's target (the module's docstring) and whether it held; no verdict where the fault-free run
    was relaunched (it is then no floor)."""
    if row["fault_free_attempts"] > 1:
        row["target"] = "none: the fault-free run was relaunched (a rank failed on its own); run it again"
        row["ok"] = False
        return
    if path == "spare":
        limit = SPARE_FIRST_STEP_S + row["steps_redone"] * row["median_step_s"]
        row["target"] = f"first step <= {limit:.2f} s (2 s + steps redone); goodput >= {SPARE_GOODPUT}"
        row["ok"] = row["first_step_s"] <= limit and row["goodput"] >= SPARE_GOODPUT
    elif path == "elastic":
        row["target"] = f"first step <= {ELASTIC_FIRST_STEP_S} s"
        row["ok"] = row["first_step_s"] <= ELASTIC_FIRST_STEP_S
    else:
        row["target"] = "none (today's requeue, to compare)"


def table(paths: dict[str, dict[str, Any]]) -> str:
    cols = ("path", "detect_s", "incident_s", "first_step_s", "steps_redone", "goodput", "fault_free_s",
            "faulted_s", "ok", "target")  # fmt: skip
    rows = [[name, *(str(row.get(c, "")) for c in cols[1:])] for name, row in paths.items()]
    widths = [max(len(c), *(len(r[i]) for r in rows)) for i, c in enumerate(cols)]
    lines = ["  ".join(c.ljust(w) for c, w in zip(cols, widths, strict=True))]
    lines += ["  ".join(v.ljust(w) for v, w in zip(r, widths, strict=True)) for r in rows]
    return "\n".join(lines)


async def measure(
    settings: Settings,
    *,
    steps: int = 200,
    kill_at: int = 60,
    ranks_per_host: int = 1,
    requeue_after_s: float = 5.0,
    warmup_steps: int = 5,
    paths: tuple[str, ...] = PATHS,
) -> dict[str, Any]:
    """The bench (see the module's docstring), with its sizes as parameters (`run` uses the defaults)."""
    if reason := cannot_make_hosts():
        raise RuntimeError(f"vigil bench elastic needs network namespaces: {reason}")
    remove_leftovers()
    rows: dict[str, dict[str, Any]] = {}
    with contextlib.ExitStack() as stack:
        root = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="vigil-bench-elastic-")))
        postgres = stack.enter_context(EmbeddedPostgres(root / "postgres"))
        network = Network.create(["a", "b", "c"])
        stack.callback(network.destroy)  # the namespaces and veths go whatever happens (also at exit)
        for path in paths:
            rows[path] = await one_path(
                path, settings, network, postgres, root,
                steps=steps, kill_at=kill_at, ranks_per_host=ranks_per_host,
                requeue_after_s=requeue_after_s, warmup_steps=warmup_steps,
            )  # fmt: skip
            judge(path, rows[path])
    print(table(rows), flush=True)
    spare = rows.get("spare", {}).get("goodput") or 0.0
    return result(
        "elastic",
        spare,
        1.0,
        unit="goodput of the spare path (fault-free wall time / faulted wall time; the floor's is 1)",
        target=f"spare: first step <= {SPARE_FIRST_STEP_S} s + steps redone, goodput >= {SPARE_GOODPUT}; "
        f"elastic: first step <= {ELASTIC_FIRST_STEP_S} s",
        paths=rows,
        ranks=2 * ranks_per_host,
        ranks_note="2 ranks (1 per host), not 4: 4 oversubscribe this machine's 2 shared cores (docstring)"
        if ranks_per_host == 1
        else f"{2 * ranks_per_host} ranks ({ranks_per_host} per host)",
        steps=steps,
        kill_at=kill_at,
        requeue_after_s=requeue_after_s,
        settings={**PLANE, "memory_every": 1, "warm_ranks": "one per slot"},
        servers="embedded nats-server (per path, on the hosts' bridge) and embedded Postgres",
        ok=all(r.get("ok", True) for r in rows.values()),
    )


async def run(settings: Settings) -> dict[str, Any]:
    return await measure(settings)
