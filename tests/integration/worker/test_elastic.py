"""An elastic job shrinks and grows back with real workers and DeepSpeed ranks (two nodes, CPU, ZeRO 1
and 2): what the ranks do with a launch at another size, as the scheduler places one.

Rank 1's node is lost at step 9 (its rank crashes): the job goes on with rank 0 alone, which parked in
its process, restores both former ranks' in-memory snapshots of step 8 (its own, and the peer copy of
rank 1 it holds), re-partitions the ZeRO optimizer state to one rank and keeps the global batch with 2
micro-steps, each reading the batch a former rank read. It crashes at step 11 and the job grows back to
2 ranks, from the 1-rank snapshot of step 10 (ZeRO 1), or from the 1-rank disk checkpoint of step 10
(ZeRO 2: the snapshots are gone). Every loss matches the fault-free 2-rank run's: at 1 rank the mean of
the two ranks' losses, up to the order of the reduction."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest

from tests.integration.worker.conftest import (
    Cluster,
    launch,
    launch_on,
    rank_logs,
    record,
    tiny_spec,
    until_exited,
)
from vigil import events as ev
from vigil.exits import EXIT_PARKED
from vigil_common import subjects
from vigil_trainer import checkpoint as ckpt

pytestmark = [pytest.mark.integration, pytest.mark.slow]

STEPS = 12
CHECKPOINT = {"every": 5, "keep": 5, "memory_every": 2}
FAULTS = [
    {"kind": "crash", "step": 9, "rank": 1, "exit_code": 7},  # rank 1's node lost: snapshot 8 is whole
    {"kind": "crash", "step": 11, "rank": 0, "exit_code": 7},  # the 1-rank attempt's: snapshot 10 whole
]
REL = 1e-4  # fp32 on one rank against two: only the order of the sums differs
# The fault-free run's losses by (rank, step), made by the first parameter: ZeRO 1 and 2 train the same fp32
# curve (in test_replay's fault-free runs they agree to the last digit), so the second compares with it too
FAULT_FREE: dict[tuple[int, int], float] = {}


def elastic_spec(zero: int, faults: list[dict[str, Any]]) -> dict[str, Any]:
    spec = tiny_spec(steps=STEPS, zero_stage=zero, checkpoint=CHECKPOINT, faults=faults)
    spec["resources"]["elastic"] = {"min_nodes": 1}
    return spec


def shm(cluster: Cluster, node: int, job_id: str) -> Path:
    return Path("/dev/shm") / f"vigil-{cluster.nodes()[node]}" / job_id


def losses(rec: Any, attempt: int) -> dict[tuple[int, int], float]:
    return {(e.rank, e.step): e.loss for e in rec.of(ev.StepCompleted, attempt=attempt)}


@pytest.fixture
def cleanup(ready_cluster: Cluster):
    jobs: list[str] = []
    yield jobs
    for job in jobs:
        for node in (0, 1):
            shutil.rmtree(shm(ready_cluster, node, job), ignore_errors=True)


async def exited(rec: Any, attempt: int, ranks: int) -> dict[int, ev.RankExited]:
    await rec.until(lambda r: len(r.exits(attempt)) == ranks, 240, fail_on_exit=False)
    return rec.exits(attempt)


@pytest.mark.parametrize("zero", [1, 2])
async def test_an_elastic_job_shrinks_to_one_rank_and_grows_back_with_the_fault_free_losses(
    ready_cluster, bus, job_id, cleanup, zero
):
    free, job = f"{job_id}-free", job_id
    cleanup += [free, job]
    if not FAULT_FREE:
        async with record(bus, free) as rec:
            await bus.publish(subjects.launch(free), launch(ready_cluster, free, elastic_spec(zero, [])))
            done = await until_exited(rec, timeout=240)
        assert {e.exit_code for e in done.values()} == {0}, rank_logs(ready_cluster, free)
        FAULT_FREE.update(losses(rec, 1))
    expected = FAULT_FREE
    assert len(expected) == 2 * STEPS

    spec = elastic_spec(zero, FAULTS)
    a = ready_cluster.nodes()[0]
    root = ready_cluster.checkpoint_root
    async with record(bus, job) as rec:
        await bus.publish(subjects.launch(job), launch(ready_cluster, job, spec))
        first = await until_exited(rec, 1, timeout=240)
        assert {r: e.exit_code for r, e in first.items()} == {0: EXIT_PARKED, 1: 7}, rank_logs(
            ready_cluster, job
        )

        # --- shrink: rank 0 alone, on node a (the scheduler's placement of an elastic job's survivors) ---
        alone = [ev.RankPlacement(rank=0, node=a, device=0, local_rank=0)]
        resume = str(ckpt.step_dir(root, job, 5))
        await bus.publish(subjects.launch(job), launch_on(alone, job, spec, attempt=2, resume_from=resume))
        second = await exited(rec, 2, 1)
        assert second[0].exit_code == 7, rank_logs(ready_cluster, job, tail=20_000)

        # --- grow back: 2 ranks from the 1-rank snapshot of step 10 (ZeRO 2: from its disk checkpoint) ---
        if zero == 2:
            for node in (0, 1):
                shutil.rmtree(shm(ready_cluster, node, job), ignore_errors=True)
        resume = str(ckpt.step_dir(root, job, 10))
        await bus.publish(
            subjects.launch(job), launch(ready_cluster, job, spec, attempt=3, resume_from=resume)
        )
        third = await until_exited(rec, 3, timeout=240)
    logs = rank_logs(ready_cluster, job, tail=10**7)
    assert {e.exit_code for e in third.values()} == {0}, logs

    pids = {(e.attempt, e.rank): e.pid for e in rec.of(ev.RankStarted)}
    assert pids[(2, 0)] == pids[(1, 0)], pids  # the survivor went on in its process (parked)
    assert min(e.step for e in rec.of(ev.StepCompleted, attempt=2)) == 8  # the snapshot, not disk step 5
    assert "the job had 2 ranks at step 8, 1 now" in logs
    assert "elastic: 1 ranks (the spec's 2): 2 micro-steps each" in logs
    shrunk = losses(rec, 2)
    assert sorted(s for _, s in shrunk) == [8, 9, 10]
    for (_, step), loss in shrunk.items():
        assert loss == pytest.approx((expected[(0, step)] + expected[(1, step)]) / 2, rel=REL), step

    grown = losses(rec, 3)
    assert sorted(grown) == [(r, s) for r in (0, 1) for s in (10, 11)]
    for key, loss in grown.items():
        assert loss == pytest.approx(expected[key], rel=REL), key
    if zero == 1:
        assert "the job had 1 ranks at step 10, 2 now" in logs
    else:
        assert "saved by 1 ranks, re-partitioned to 2" in logs
