"""A restarted worker finds the ranks it had started, or learns how they ended, and reports the truth."""

from __future__ import annotations

import asyncio
import os

import pytest

from tests.helpers import eventually
from tests.integration.worker.conftest import (
    launch,
    launch_on,
    rank_logs,
    record,
    start_worker,
    stop_worker,
    tiny_spec,
    until_exited,
    wait_heartbeat,
)
from vigil import events as ev
from vigil.exits import EXIT_PARKED
from vigil_common import subjects
from vigil_worker.procs import start_ticks

pytestmark = [pytest.mark.integration, pytest.mark.slow]


async def gone(pid: int, timeout: float = 60.0) -> None:
    """Wait for a process that is not our child to end: its pidfd becomes readable then."""
    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:
        return
    ended = asyncio.Event()
    loop = asyncio.get_running_loop()
    loop.add_reader(fd, ended.set)
    try:
        await asyncio.wait_for(ended.wait(), timeout)
    finally:
        loop.remove_reader(fd)
        os.close(fd)


async def test_restarted_worker_adopts_running_ranks_and_reports_how_they_ended(
    ready_cluster, bus, nats_url, job_id
):
    spec = tiny_spec(steps=2000, checkpoint={"every": 1000, "keep": 2})
    node_a = ready_cluster.workers[0].node
    async with record(bus, job_id) as rec:
        await bus.publish(subjects.launch(job_id), launch(ready_cluster, job_id, spec))
        await rec.until(lambda r: r.of(ev.StepCompleted, rank=0, step=2))
        rank0 = rec.of(ev.RankStarted, rank=0)[0]

        # the worker goes away; its rank trains on (its link keeps what the agent could not take)
        await asyncio.to_thread(stop_worker, ready_cluster.workers[0])
        seen = max(e.step for e in rec.of(ev.StepCompleted, rank=0))

        # back again: it finds the rank and keeps its slot busy; the rank's link reconnects to the new
        # agent (the rank's token is kept on the node) and sends the steps trained meanwhile
        ready_cluster.workers[0] = start_worker(nats_url, ready_cluster.data_dir, node_a, 1)
        beat = await wait_heartbeat(bus, node_a)
        assert beat.free == [] and [d.kind for d in beat.devices] == ["cpu"]
        await rec.until(lambda r: r.of(ev.StepCompleted, rank=0, step=seen + 3))
        assert not rec.of(ev.RankExited)

        # down again; meanwhile the job is cancelled: node b ends rank 1 and rank 0 fails out of its
        # collective: it parks in its process (waiting for a next attempt), with nobody watching
        await asyncio.to_thread(stop_worker, ready_cluster.workers[0])
        await bus.publish(subjects.cmd(job_id), ev.CancelJob(job_id=job_id, attempt=1, reason="test"))
        await rec.until(lambda r: r.exits().get(1), fail_on_exit=False)

        async def parked() -> list[object]:
            try:
                return list(ready_cluster.data_dir.glob(f"**/{job_id}/attempt-1/rank-0.parked"))
            except FileNotFoundError:  # the walk met a folder removed under it (a job's clean-up): again
                return []

        await eventually(parked, timeout=60, what="rank 0 parked")
        assert 0 not in rec.exits() and start_ticks(rank0.pid) is not None  # nobody watching: still parked

        # the restarted worker reports it (parked: exit code 6, a failure) and, taking the cancel, ends it
        ready_cluster.workers[0] = start_worker(nats_url, ready_cluster.data_dir, node_a, 1)
        exits = await until_exited(rec, timeout=60)
        await gone(rank0.pid)
    assert exits[1].failure == "killed_by_vigil"
    assert exits[0].node == node_a and exits[0].exit_code == EXIT_PARKED, rank_logs(ready_cluster, job_id)
    assert exits[0].failure == "error"
    beat = await wait_heartbeat(bus, node_a)
    assert beat.free == [0]
    assert start_ticks(rank0.pid) is None


async def test_a_worker_told_to_end_its_ranks_on_stop_does_so(bus, nats_url, tmp_path, job_id, monkeypatch):
    """One worker with two slots runs both ranks; stopping it (as `vigil up` does) ends them."""
    monkeypatch.setenv("VIGIL_WORKER_END_RANKS_ON_STOP", "true")
    node = "node-" + job_id[2:8] + "-solo"
    worker = start_worker(nats_url, tmp_path, node, 2)
    try:
        await wait_heartbeat(bus, node)
        placement = [ev.RankPlacement(rank=r, node=node, device=r, local_rank=r) for r in (0, 1)]
        spec = tiny_spec(steps=2000, checkpoint={"every": 1000, "keep": 2})
        solo = launch_on(placement, job_id, spec)
        async with record(bus, job_id) as rec:
            await bus.publish(subjects.launch(job_id), solo)
            await rec.until(lambda r: r.of(ev.StepCompleted, rank=1, step=1))
            await asyncio.to_thread(stop_worker, worker)
            exits = await until_exited(rec, timeout=60)
    finally:
        await asyncio.to_thread(stop_worker, worker)
    assert worker.proc.returncode == 0, worker.log.read_text()[-3000:]
    assert {e.failure for e in exits.values()} == {"killed_by_vigil"}
