"""Out-of-memory recovery with real ranks: an injected `torch.OutOfMemoryError` on one rank is agreed at
the step boundary, the step retried with half the micro-batch on every rank (global batch and tokens
unchanged, so the loss curve is the unfaulted run's); a second one halts the job after an emergency
checkpoint, with an `oom` incident."""

from __future__ import annotations

import pytest

from tests.integration.worker.conftest import launch, rank_logs, record, tiny_spec, until_exited
from vigil import events as ev
from vigil_common import subjects
from vigil_trainer import checkpoint as ckpt

pytestmark = [pytest.mark.integration, pytest.mark.slow]

OOM_STEP = 3


def losses(rec, rank: int) -> dict[int, float]:
    return {e.step: e.loss for e in rec.of(ev.StepCompleted, rank=rank)}


async def test_oom_is_retried_split_with_the_same_global_batch(ready_cluster, bus, job_id):
    """ZeRO-1: DeepSpeed skips the poisoned update (the next test covers ZeRO-0, where the guard does)."""
    steps, zero_stage = 7, 1
    clean = tiny_spec(steps=steps, zero_stage=zero_stage, checkpoint={"every": 100, "keep": 2})
    faulty = tiny_spec(
        steps=steps,
        zero_stage=zero_stage,
        checkpoint={"every": 100, "keep": 2},
        faults=[{"kind": "oom", "step": OOM_STEP, "rank": 1}],
    )
    runs = {}
    for name, spec in (("clean", clean), ("oom", faulty)):
        jid = f"{job_id}-{name}"
        async with record(bus, jid) as rec:
            await bus.publish(subjects.launch(jid), launch(ready_cluster, jid, spec))
            exits = await until_exited(rec, timeout=180)
        assert {e.exit_code for e in exits.values()} == {0}, rank_logs(ready_cluster, jid)
        runs[name] = rec

    rec = runs["oom"]
    for rank in (0, 1):
        got = rec.of(ev.StepCompleted, rank=rank)
        assert sorted(e.step for e in got) == list(range(steps)), "every step once, none lost or repeated"
        for e in got:
            assert e.tokens == 4 * 32, "the global batch is unchanged"
            assert e.micro_batch == (2 if e.step >= OOM_STEP else 4), (e.step, e.micro_batch)
            assert not e.skipped
    # the same tokens in the same order: the loss curve is the unfaulted run's, step for step
    want, have = losses(runs["clean"], 0), losses(rec, 0)
    for step in range(steps):
        assert have[step] == pytest.approx(want[step], rel=1e-4, abs=1e-5), (step, have, want)
    logs = rank_logs(ready_cluster, f"{job_id}-oom")
    assert f"step {OOM_STEP}: rank 1 ran out of memory; retrying with micro-batch 2 x 2 accumulation" in logs


async def test_a_second_oom_halts_after_an_emergency_checkpoint_and_is_reported(ready_cluster, bus, job_id):
    spec = tiny_spec(
        steps=8,
        zero_stage=0,  # fp32 without ZeRO: the guard's GuardedAdamW skips each poisoned update
        checkpoint={"every": 100, "keep": 2},
        faults=[{"kind": "oom", "step": OOM_STEP, "rank": 1, "repeat": True}],
    )
    async with record(bus, job_id) as rec:
        await bus.publish(subjects.launch(job_id), launch(ready_cluster, job_id, spec))
        halted = (await rec.until(lambda r: r.of(ev.RanksHalted), timeout=180))[0]
        (report,) = await rec.until(lambda r: r.of(ev.OutOfMemoryHalted), timeout=30)
        saved = rec.of(ev.CheckpointSaved)
        await bus.publish(subjects.cmd(job_id), ev.CancelJob(job_id=job_id, attempt=1, reason="test done"))
        exits = await until_exited(rec, timeout=60)

    # the ranks report it; the guardian records it as the `oom` incident (tests/unit/guardian/test_watch.py)
    assert (report.step, report.rank, report.micro_batch, report.checkpoint_step) == (
        OOM_STEP,
        1,
        2,
        OOM_STEP,
    )
    assert halted.command_id == report.event_id and halted.step == OOM_STEP - 1
    # the emergency checkpoint holds every step done before the failed one, and verifies
    assert [e.step for e in saved] == [0, OOM_STEP]
    m = ckpt.verify(saved[-1].path, root=ready_cluster.checkpoint_root)
    assert m.step == OOM_STEP and m.data_position == OOM_STEP
    assert sorted(e.step for e in rec.of(ev.StepCompleted, rank=0)) == list(range(OOM_STEP))
    assert {e.failure for e in exits.values()} == {"killed_by_vigil"}
