"""In-place rollback: equal to a fresh run resumed from the same checkpoint; a corrupt one is refused."""

from __future__ import annotations

import asyncio
import shutil
import sys
from pathlib import Path

import pytest
import torch

from tests.integration.worker.conftest import launch, rank_logs, record, tiny_spec, until_exited
from vigil import events as ev
from vigil.integrations import ds_compat
from vigil_common import subjects
from vigil_trainer import checkpoint as ckpt

pytestmark = [pytest.mark.integration, pytest.mark.slow]


def weights(step_dir: Path) -> dict[str, torch.Tensor]:
    with torch.serialization.safe_globals(ds_compat.checkpoint_safe_globals()):
        return ckpt.safe_load(step_dir / ckpt.DS_TAG / "mp_rank_00_model_states.pt")["module"]


async def halt(bus, rec, job_id: str) -> ev.RanksHalted:
    await bus.publish(subjects.cmd(job_id), ev.HaltJob(job_id=job_id, attempt=1, reason="test"))
    return (await rec.until(lambda r: r.of(ev.RanksHalted)))[0]


async def rollback(
    bus, rec, job_id: str, checkpoint: Path, step: int, skip: tuple[int, int] | None = None
) -> ev.RollbackCompleted:
    await bus.publish(
        subjects.cmd(job_id),
        ev.RollbackJob(
            job_id=job_id, attempt=1, checkpoint=str(checkpoint), step=step, skip_data=skip, reason="test"
        ),
    )
    return (await rec.until(lambda r: r.of(ev.RollbackCompleted)))[0]


async def test_in_place_rollback_equals_a_fresh_run_resumed_from_the_checkpoint(ready_cluster, bus, job_id):
    root = ready_cluster.checkpoint_root
    spec = tiny_spec(steps=24, checkpoint={"every": 4, "keep": 10})
    async with record(bus, job_id) as a:
        await bus.publish(subjects.launch(job_id), launch(ready_cluster, job_id, spec))
        await a.until(lambda r: r.of(ev.StepCompleted, rank=0, step=9))
        step4 = ckpt.step_dir(root, job_id, 4)
        await halt(bus, a, job_id)
        done = await rollback(bus, a, job_id, step4, 4)
        await until_exited(a, timeout=120)
    assert {e.exit_code for e in a.exits().values()} == {0}, rank_logs(ready_cluster, job_id)
    assert done.to_step == 4 and done.from_step >= 9 and Path(done.checkpoint) == step4
    # the ranks went back: step 4 ran twice, in the same processes
    assert len(a.of(ev.StepCompleted, rank=0, step=4)) == 2
    assert len({e.pid for e in a.of(ev.RankStarted)}) == 2

    fresh = job_id + "-fresh"
    # a job resumes only from its own folder (another job's checkpoint is refused): give it a copy
    own = ckpt.step_dir(root, fresh, 4)
    shutil.copytree(step4, own)
    async with record(bus, fresh) as b:
        await bus.publish(subjects.launch(fresh), launch(ready_cluster, fresh, spec, resume_from=str(own)))
        await until_exited(b, timeout=120)
    assert {e.exit_code for e in b.exits().values()} == {0}, rank_logs(ready_cluster, fresh)
    assert min(e.step for e in b.of(ev.StepCompleted)) == 4

    # same parameters at the end...
    wa, wb = weights(ckpt.step_dir(root, job_id, 24)), weights(ckpt.step_dir(root, fresh, 24))
    assert wa.keys() == wb.keys()
    for name in wa:
        torch.testing.assert_close(wa[name], wb[name], rtol=1e-5, atol=1e-6, msg=name)
    # ...and the same losses on the way (the run after the rollback vs the fresh run)
    after = {e.step: e.loss for e in a.events if isinstance(e, ev.StepCompleted) and e.rank == 1}
    fresh_losses = {e.step: e.loss for e in b.of(ev.StepCompleted, rank=1)}
    for s in range(4, 24):
        assert after[s] == pytest.approx(fresh_losses[s], rel=1e-5), s


async def test_corrupt_checkpoint_is_refused_and_the_previous_good_one_used(ready_cluster, bus, job_id):
    root = ready_cluster.checkpoint_root
    # no in-memory snapshot: the rollback reads the disk (test_snapshots.py: one held in memory reads none)
    spec = tiny_spec(steps=400, checkpoint={"every": 4, "keep": 50, "memory_every": 0})
    async with record(bus, job_id) as rec:
        await bus.publish(subjects.launch(job_id), launch(ready_cluster, job_id, spec))
        await rec.until(lambda r: r.of(ev.CheckpointSaved, step=8))
        await halt(bus, rec, job_id)
        step8 = ckpt.step_dir(root, job_id, 8)
        victim = step8 / ckpt.DS_TAG / "mp_rank_00_model_states.pt"
        data = bytearray(victim.read_bytes())
        data[len(data) // 2] ^= 0xFF  # one flipped byte, same size
        victim.write_bytes(bytes(data))
        cli = await asyncio.create_subprocess_exec(
            str(Path(sys.executable).parent / "vigil"), "checkpoint", "verify", str(step8),
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
        )  # fmt: skip
        _, err = await cli.communicate()
        assert cli.returncode == 1 and b"SHA-256" in err

        done = await rollback(bus, rec, job_id, step8, 8, skip=(4, 6))
        assert Path(done.checkpoint) == ckpt.step_dir(root, job_id, 4) and done.to_step == 4
        seen = len(rec.of(ev.StepCompleted))
        for rank in (0, 1):  # training goes on from step 4
            await rec.until(
                lambda r, rank=rank: any(
                    e.rank == rank and e.step == 4 for e in r.events[seen:] if isinstance(e, ev.StepCompleted)
                )
            )
        await bus.publish(subjects.cmd(job_id), ev.CancelJob(job_id=job_id, attempt=1, reason="test over"))
        await until_exited(rec, timeout=60)
    # the data window [4, 6) is skipped: step 4 now reads data position 6
    replayed = [e for e in rec.events[seen:] if isinstance(e, ev.StepCompleted) and e.step == 4]
    assert {e.data_position for e in replayed} == {6}
    assert "refusing checkpoint" in rank_logs(ready_cluster, job_id, tail=10**7)
