"""Real DeepSpeed ranks on CPU, launched by real workers, over real NATS."""

from __future__ import annotations

import asyncio
import math
import time

import pytest

from tests.integration.worker.conftest import launch, rank_logs, record, tiny_spec, until_exited
from vigil import events as ev
from vigil_common import subjects
from vigil_trainer import checkpoint as ckpt

pytestmark = [pytest.mark.integration, pytest.mark.slow]


@pytest.mark.parametrize("zero_stage", [1, 2, 3])
async def test_two_rank_job_on_two_workers(ready_cluster, bus, job_id, zero_stage):
    accum = 2 if zero_stage == 2 else 1  # one case with gradient accumulation
    spec = tiny_spec(steps=8, zero_stage=zero_stage, grad_accum=accum)
    async with record(bus, job_id) as rec:
        t0 = time.monotonic()
        await bus.publish(subjects.launch(job_id), launch(ready_cluster, job_id, spec))
        await until_exited(rec, timeout=180)
        elapsed = time.monotonic() - t0
    logs = rank_logs(ready_cluster, job_id)
    assert {e.rank: e.exit_code for e in rec.exits().values()} == {0: 0, 1: 0}, logs
    assert all(e.failure == "ok" for e in rec.exits().values())
    started = rec.of(ev.RankStarted)
    assert {(e.rank, e.node) for e in started} == {
        (0, ready_cluster.nodes()[0]),
        (1, ready_cluster.nodes()[1]),
    }

    steps = rec.of(ev.StepCompleted)
    for rank in (0, 1):
        assert sorted(e.step for e in steps if e.rank == rank) == list(range(8)), f"rank {rank}"
    by_step = {e.step: e for e in steps if e.rank == 0}
    assert by_step[7].loss < by_step[0].loss - 0.3, [round(by_step[s].loss, 3) for s in range(8)]
    for e in steps:
        assert (
            e.tokens == 4 * 32 * accum
            and e.step_time_s > 0
            and e.forward_time_s > 0
            and e.backward_time_s > 0
        )
        assert e.comm_time_s > 0, "gradient reduction happened, so it was measured"
        assert e.comm_time_s < e.step_time_s
        assert e.grad_norm is not None and math.isfinite(e.grad_norm) and not e.skipped
        assert e.mem_allocated_bytes and e.lr > 0

    saved = rec.of(ev.CheckpointSaved)
    assert sorted(e.step for e in saved) == [0, 4, 8]
    for e in saved:
        m = ckpt.verify(e.path, root=ready_cluster.checkpoint_root)
        assert m.sha256 == e.manifest_sha256 and m.step == e.step and m.bytes == e.bytes
    print(f"zero {zero_stage}: launch to both exits {elapsed:.1f}s")


async def test_crashed_rank_is_reported_with_its_exit_code(ready_cluster, bus, job_id):
    spec = tiny_spec(steps=50, faults=[{"kind": "crash", "step": 2, "rank": 1, "exit_code": 7}])
    async with record(bus, job_id) as rec:
        await bus.publish(subjects.launch(job_id), launch(ready_cluster, job_id, spec))
        await until_exited(rec, timeout=120)
    exits = rec.exits()
    assert exits[1].exit_code == 7 and exits[1].failure == "error", rank_logs(ready_cluster, job_id)
    assert "injected crash at step 2" in exits[1].log_tail
    # its partner does not linger: ended by its worker or failed out of the broken collective
    assert exits[0].failure in ("killed_by_vigil", "error", "signal")
    assert max(e.step for e in rec.of(ev.StepCompleted, rank=1)) == 1
    assert exits[1].last_step == 1  # the last step it reported, noted beside its exit file


async def test_halt_leaves_no_rank_blocked(ready_cluster, bus, job_id):
    spec = tiny_spec(steps=400, checkpoint={"every": 1000, "keep": 2})
    async with record(bus, job_id) as rec:
        await bus.publish(subjects.launch(job_id), launch(ready_cluster, job_id, spec))
        await rec.until(lambda r: r.of(ev.StepCompleted, step=2))
        # the worker samples its slot: the rank's process, honestly labelled as a CPU slot
        async with bus.watch(subjects.gpu(ready_cluster.nodes()[1])) as samples:
            sample = await asyncio.wait_for(anext(s async for s in samples if s.job_id == job_id), 30)
        assert sample.device_kind == "cpu" and sample.memory_used_bytes > 0 and sample.temperature_c is None
        await bus.publish(subjects.cmd(job_id), ev.HaltJob(job_id=job_id, attempt=1, reason="test"))
        halted = (await rec.until(lambda r: r.of(ev.RanksHalted)))[0]
        # both ranks stopped at the same boundary: each finished it, and no step after it comes (events of
        # different ranks travel independently, so wait for both before looking)
        await rec.until(lambda r: all(r.of(ev.StepCompleted, rank=k, step=halted.step) for k in (0, 1)))
        assert max(e.step for e in rec.of(ev.StepCompleted)) == halted.step
        # neither rank sits in a collective: both take the resume and step on
        await bus.publish(subjects.cmd(job_id), ev.ResumeJob(job_id=job_id, attempt=1))
        for rank in (0, 1):
            await rec.until(lambda r, rank=rank: r.of(ev.StepCompleted, rank=rank, step=halted.step + 2))
        # a command for another attempt is ignored
        await bus.publish(subjects.cmd(job_id), ev.HaltJob(job_id=job_id, attempt=9, reason="stale"))
        await bus.publish(subjects.cmd(job_id), ev.CancelJob(job_id=job_id, attempt=1, reason="test over"))
        await until_exited(rec, timeout=60)
    assert len(rec.of(ev.RanksHalted)) == 1
    # each worker ends its own rank; a rank whose partner died first may fail out of the collective
    failures = [e.failure for e in rec.exits().values()]
    assert "killed_by_vigil" in failures and set(failures) <= {"killed_by_vigil", "error"}


async def test_a_launch_for_an_attempt_already_run_is_ignored(ready_cluster, bus, job_id):
    first = launch(ready_cluster, job_id, tiny_spec(steps=2))
    other = job_id + "-next"
    async with record(bus, job_id) as rec, record(bus, other) as rec_other:
        await bus.publish(subjects.launch(job_id), first)
        await until_exited(rec)
        # the same attempt again (a redelivery or a confused scheduler), then another job
        await bus.publish(subjects.launch(job_id), first.model_copy(update={"event_id": ev.new_id()}))
        await bus.publish(subjects.launch(other), launch(ready_cluster, other, tiny_spec(steps=1)))
        # launches are handled in order: once the next job's ranks start, the repeat was seen
        await rec_other.until(lambda r: len(r.of(ev.RankStarted)) == 2)
        await until_exited(rec_other)
    assert len(rec.of(ev.RankStarted)) == 2, "the repeated launch started nothing"
    assert {e.exit_code for e in rec_other.exits().values()} == {0}
