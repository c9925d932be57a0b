"""`train.compile: true` on CPU (inductor), with real DeepSpeed ranks: the loss curve is the eager run's,
and nothing recompiles after the first step: not a held and replayed step, not an in-place rollback
(a checkpoint load copies into the same tensors), not the replay after it.

Tolerance: inductor fuses the RMSNorm, RoPE, SwiGLU and cross-entropy kernels, so fp32 sums run in
another order. One step's loss then differs by a few ulps; training at lr 3e-3 carries that into the
weights and the difference grows with the steps: at most 6e-7 relative over 16 steps in the runs made
while writing this test (run with -s to see it). A bug (a wrong graph, a stale parameter after a load, a
step applied twice) moves the loss by 1e-2 or more, so rel=2e-4 keeps a wide margin on both sides.
"""

from __future__ import annotations

import asyncio
import re
import time
from collections.abc import Iterator

import pytest

from tests.integration.worker.conftest import (
    Cluster,
    heartbeating,
    launch,
    rank_logs,
    record,
    tiny_spec,
    two_workers,
    until_exited,
)
from tests.integration.worker.test_rollback import halt, rollback
from vigil import events as ev
from vigil_common import subjects
from vigil_trainer import checkpoint as ckpt

pytestmark = [pytest.mark.integration, pytest.mark.slow]

STEPS = 16
TOLERANCE = 2e-4
FAULTS = [{"kind": "sdc", "step": 2, "rank": 1}]  # a NaN on rank 1's first execution of step 2: held
GRAPHS = re.compile(r"torch\.compile: (\d+) graph\(s\) built")


@pytest.fixture(scope="module")
def shared_cache_workers(nats_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    """Workers whose ranks run as the worker (VIGIL_JOB_UIDS=off), so they share this module's inductor
    cache: the ZeRO 1 graph of the out-of-memory test is the ZeRO 2 graph the first test built, loaded
    from the cache rather than built again (about a minute on two cores). Dynamo still traces it, so the
    graph counts asserted are the same. A job of its own user has a private cache (launch.rank_env);
    test_compile_under_each_zero_stage compiles so, on the usual workers."""
    data_dir = tmp_path_factory.mktemp("compile-data")
    cache = data_dir / "inductor-cache"
    with two_workers(nats_url, data_dir, VIGIL_JOB_UIDS="off", TORCHINDUCTOR_CACHE_DIR=str(cache)) as c:
        yield c


@pytest.fixture
async def shared_cache_cluster(shared_cache_workers: Cluster, bus) -> Cluster:
    return await heartbeating(shared_cache_workers, bus)


def spec(compile_: bool) -> dict:
    # ZeRO 2: its gradients are reduced in the backward's hooks, the stage a compiled graph meets most
    s = tiny_spec(steps=STEPS, faults=FAULTS, checkpoint={"every": 4, "keep": 10}, zero_stage=2)
    s["train"]["compile"] = compile_
    s["guardian"] = {"spike_warmup": 3}
    return s


def last_losses(rec, rank: int) -> dict[int, float]:
    """Each step's loss as it went on (after a rollback, the re-run's)."""
    return {e.step: e.loss for e in rec.of(ev.StepCompleted, rank=rank)}


async def test_compiled_run_equals_eager_across_a_hold_a_rollback_and_a_replay(
    shared_cache_cluster, bus, job_id
):
    ready_cluster = shared_cache_cluster
    root = ready_cluster.checkpoint_root
    compiled = f"{job_id}-compiled"
    async with record(bus, compiled) as a:
        await bus.publish(subjects.launch(compiled), launch(ready_cluster, compiled, spec(True)))
        await a.until(lambda r: r.of(ev.StepCompleted, rank=0, step=9), timeout=300)
        await halt(bus, a, compiled)
        done = await rollback(bus, a, compiled, ckpt.step_dir(root, compiled, 4), 4)
        await until_exited(a, timeout=300)
    logs = rank_logs(ready_cluster, compiled, tail=200_000)
    assert {e.exit_code for e in a.exits().values()} == {0}, logs[-4000:]
    assert done.to_step == 4
    assert [(r.step, r.outcome) for r in a.of(ev.StepReplayed)] == [(2, "transient")]
    assert len(a.of(ev.StepCompleted, rank=0, step=5)) == 2  # step 5 ran again after the rollback
    # every rank built one graph (its forward and backward) at its first step, and none after
    graphs = [int(n) for n in GRAPHS.findall(logs)]
    assert graphs == [1, 1], logs[-4000:]

    eager = f"{job_id}-eager"
    async with record(bus, eager) as b:
        await bus.publish(subjects.launch(eager), launch(ready_cluster, eager, spec(False)))
        await until_exited(b, timeout=300)
    assert {e.exit_code for e in b.exits().values()} == {0}, rank_logs(ready_cluster, eager)
    assert not GRAPHS.search(rank_logs(ready_cluster, eager, tail=200_000))  # compile off: nothing built

    for rank in (0, 1):
        got, want = last_losses(a, rank), last_losses(b, rank)
        assert sorted(got) == sorted(want) == list(range(STEPS))
        worst = max(abs(got[s] - want[s]) / abs(want[s]) for s in range(STEPS))
        print(f"rank {rank}: largest relative loss difference compiled vs eager {worst:.2e}")
        for step in range(STEPS):
            assert got[step] == pytest.approx(want[step], rel=TOLERANCE), (rank, step, got[step], want[step])


# The stages a compiled graph meets differently: ZeRO 0 and 1 reduce gradients after the backward (the
# out-of-memory test compiles at 1), ZeRO 2 in the backward's hooks (the hold, rollback and replay test
# above runs at 2), ZeRO 3 gathers parameters in the forward (here). One test each, to keep CI in its time.
@pytest.mark.parametrize("zero_stage", [3])
async def test_compile_under_each_zero_stage(ready_cluster, bus, job_id, zero_stage):
    runs = {}
    for on in (True, False):
        s = tiny_spec(steps=6, zero_stage=zero_stage, checkpoint={"every": 100})
        s["train"]["compile"] = on
        name = f"{job_id}-z{zero_stage}-{'compiled' if on else 'eager'}"
        async with record(bus, name) as rec:
            await bus.publish(subjects.launch(name), launch(ready_cluster, name, s))
            await until_exited(rec, timeout=300)
        logs = rank_logs(ready_cluster, name, tail=200_000)
        assert {e.exit_code for e in rec.exits().values()} == {0}, logs[-4000:]
        graphs = [int(n) for n in GRAPHS.findall(logs)]
        if not on:
            assert graphs == [], logs[-4000:]
        elif zero_stage < 3:
            assert graphs == [1, 1], logs[-4000:]
        else:  # ZeRO 3: a graph break at each parameter gather (why `auto` leaves it eager), same on both
            assert len(graphs) == 2 and graphs[0] == graphs[1] > 1, logs[-4000:]
        runs[on] = rec
        # the job ran as its own user with its own TMPDIR (inductor's precompiled headers went there, not
        # to /tmp/torchinductor_<uid> for the uid's next job), removed once it had no rank left here
        tmp = ready_cluster.data_dir / "runs" / name / "tmp"
        deadline = time.monotonic() + 60
        while tmp.exists():
            assert time.monotonic() < deadline, f"{tmp} still there after the job ended"
            await asyncio.sleep(0.1)  # polling a folder the worker removes
    for rank in (0, 1):
        got, want = last_losses(runs[True], rank), last_losses(runs[False], rank)
        assert sorted(got) == sorted(want) == list(range(6))
        for step in range(6):
            assert got[step] == pytest.approx(want[step], rel=TOLERANCE), (rank, step)


async def test_an_out_of_memory_retry_costs_one_recompile_at_most(shared_cache_cluster, bus, job_id):
    """The retry runs micro-batches of half the size: one new graph, built once, dynamic in the batch from
    then on (the split stays for the rest of the job)."""
    ready_cluster = shared_cache_cluster
    s = tiny_spec(
        steps=7, zero_stage=1, checkpoint={"every": 100}, faults=[{"kind": "oom", "step": 3, "rank": 1}]
    )
    s["train"]["compile"] = True
    async with record(bus, job_id) as rec:
        await bus.publish(subjects.launch(job_id), launch(ready_cluster, job_id, s))
        await until_exited(rec, timeout=300)
    logs = rank_logs(ready_cluster, job_id, tail=200_000)
    assert {e.exit_code for e in rec.exits().values()} == {0}, logs[-4000:]
    assert {e.micro_batch for e in rec.of(ev.StepCompleted, rank=0) if e.step >= 3} == {2}
    assert [int(n) for n in GRAPHS.findall(logs)] == [2, 2], logs[-4000:]
