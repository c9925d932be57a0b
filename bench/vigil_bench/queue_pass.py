"""One placement pass's cost, alone: `python -m vigil_bench.queue_pass [fair|strict] [PASSES]`.

`vigil bench queue` runs passes among everything else a scheduler does, on a machine its simulated clusters
share; this times `Scheduler.schedule_pass` by itself, in this process, on one embedded Postgres, over the
state the queue bench's saturated runs reach: 64 nodes x 8 GPUs all held by running jobs (priority 10, with
time limits, ranks started), 80 more queued (1-64 GPUs, the trace's mix, priority 10: no victim, so the pass
goes through the reservation and the whole preemption search), 300 finished attempts of usage history, and
the trace's three teams and shares. Nothing is placed or preempted: every pass is the same. Prints one JSON
line: median and p90 wall milliseconds a pass, median CPU milliseconds of this process a pass (the
database's own work not counted), and the state it ran on.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import sys
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from vigil.events import Device, NodeHeartbeat
from vigil.jobstates import JobState
from vigil.spec import JobSpec
from vigil_bench import percentile
from vigil_bench.elastic import fresh_database
from vigil_bench.queue_trace import SIZES, TEAMS
from vigil_common.db import create_pool
from vigil_common.embedded import EmbeddedPostgres
from vigil_common.settings import Settings
from vigil_scheduler import inventory, lifecycle
from vigil_scheduler.core import Scheduler
from vigil_scheduler.principals import Principal

NODES, DEVICES, QUEUED, HISTORY = 64, 8, 80, 300


class _NoRelay:
    """The outbox relay's wake-up, with nothing to publish to (nothing is placed)."""

    def wake(self) -> None: ...


def _spec(rng: random.Random, name: str, priority: int) -> JobSpec:
    gpus = rng.choices([g for g, _ in SIZES], [p for _, p in SIZES])[0]
    nodes = max(1, gpus // DEVICES)
    return JobSpec.model_validate(
        {
            "name": name,
            "priority": priority,
            "resources": {"nodes": nodes, "gpus_per_node": gpus // nodes},
            "scheduling": {"time_limit": rng.uniform(60, 3600)},
        }
    )


async def _saturate(scheduler: Scheduler, rng: random.Random) -> dict[str, int]:
    """The state above, through the scheduler's own submit and pass where it can."""
    pool, now = scheduler.pool, datetime.now(UTC)
    beats = [
        NodeHeartbeat(
            node=f"n{i:03d}",
            address="127.0.0.1",
            devices=[Device(index=d, kind="gpu", name="sim", uuid=f"GPU-{i}-{d}") for d in range(DEVICES)],
            free=list(range(DEVICES)),
            interval_s=3600.0,
            started_at=now,
        )
        for i in range(NODES)
    ]
    users = {t.name: Principal(name=f"u-{t.name}", actor=f"user:u-{t.name}", team=t.name) for t in TEAMS}
    async with pool.acquire() as conn, conn.transaction():
        await inventory.record_heartbeats(conn, beats)
        await conn.executemany(
            "INSERT INTO teams (name, share) VALUES ($1, $2)", [(t.name, t.share) for t in TEAMS]
        )
        for i in range(HISTORY):
            team = rng.choice(TEAMS)
            spec = _spec(rng, f"old-{i}", team.priority)
            job = await lifecycle.insert_job(
                conn, f"j-old{i:05d}", spec, {}, owner=f"u-{team.name}", team=team.name
            )
            ago = rng.uniform(60, 6 * 3600)
            await conn.execute(
                "UPDATE jobs SET state = 'SUCCEEDED', queued = false,"
                " finished_at = now() - make_interval(secs => $2) WHERE id = $1",
                job.id,
                ago,
            )
            await conn.executemany(
                "INSERT INTO job_ranks (job_id, attempt, rank, node, started_at, exited_at) VALUES"
                " ($1, 1, $2, 'n000', now() - make_interval(secs => $3), now() - make_interval(secs => $4))",
                [(job.id, r, ago + rng.uniform(60, 3600), ago) for r in range(spec.resources.world_size)],
            )
    shared = [t.name for t in TEAMS if t.priority == 10]  # the equal-priority teams: nobody preempts
    for i in range(10 * NODES):  # fill the cluster until jobs start to queue
        await scheduler.submit(_spec(rng, f"run-{i}", 10), users[rng.choice(shared)])
        await scheduler.schedule_pass()
        if await pool.fetchval("SELECT count(*) FROM jobs WHERE queued") >= 3:
            break
    async with pool.acquire() as conn, conn.transaction():
        rows = await conn.fetch(f"SELECT {lifecycle.JOB_COLUMNS} FROM jobs WHERE state = 'SCHEDULED'")
        for job in map(lifecycle.Job.from_row, rows):
            await lifecycle.transition(conn, job, JobState.RUNNING, "queue_pass: running")
            ago = rng.uniform(10, 1800)
            await conn.executemany(
                "INSERT INTO job_ranks (job_id, attempt, rank, node, started_at)"
                " VALUES ($1, $2, $3, $4, now() - make_interval(secs => $5))",
                [(job.id, job.attempt, p["rank"], p["node"], ago) for p in job.placement or []],
            )
        await conn.execute("UPDATE devices SET reported_free = false WHERE job_id IS NOT NULL")
    for i in range(QUEUED):
        await scheduler.submit(_spec(rng, f"queued-{i}", 10), users[rng.choice(shared)])
    for _ in range(3):  # settle: the last gaps filled
        await scheduler.schedule_pass()
    row = await pool.fetchrow(
        "SELECT count(*) FILTER (WHERE queued) AS queued, count(*) FILTER (WHERE state = 'RUNNING')"
        " AS running, (SELECT count(*) FROM devices WHERE job_id IS NULL) AS free_devices FROM jobs"
    )
    return dict(row)


async def run(policy: str, passes: int, data: Path) -> dict[str, Any]:
    with EmbeddedPostgres(data / "postgres") as server:
        url = await fresh_database(server, f"queue_pass_{policy}")
        settings = Settings.load(database_url=url, queue_policy=policy, data_dir=data)
        pool = await create_pool(url, max_size=4)
        try:
            scheduler = Scheduler(settings, pool, _NoRelay())  # type: ignore[arg-type]
            state = await _saturate(scheduler, random.Random(1))
            walls, cpus = [], []
            for _ in range(passes):
                wall, cpu = time.perf_counter(), time.process_time()
                placed = await scheduler.schedule_pass()
                walls.append(time.perf_counter() - wall)
                cpus.append(time.process_time() - cpu)
                assert not placed, "the pass placed a job: the state is not saturated"
        finally:
            await pool.close()
    return {
        "bench": "queue_pass",
        "policy": policy,
        "passes": passes,
        "wall_ms_median": round(1000 * percentile(walls, 0.5), 2),
        "wall_ms_p90": round(1000 * percentile(walls, 0.9), 2),
        "cpu_ms_median": round(1000 * percentile(cpus, 0.5), 2),
        **state,
        "loadavg": round(os.getloadavg()[0], 2),
    }


def main() -> None:
    policy = sys.argv[1] if len(sys.argv) > 1 else "fair"
    passes = int(sys.argv[2]) if len(sys.argv) > 2 else 200
    with tempfile.TemporaryDirectory(prefix="vigil-queue-pass-") as tmp:
        print(json.dumps(asyncio.run(run(policy, passes, Path(tmp)))))


if __name__ == "__main__":
    main()
