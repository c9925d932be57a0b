"""In-memory snapshots with real workers and DeepSpeed ranks (two nodes, one rank each, ZeRO-1, CPU).

A crashed rank relaunched without its own copy takes it from its peer on the other node, and the loss
curve is the fault-free run's with at most `memory_every` steps redone; a corrupt or torn snapshot is
refused and the next whole one used; an in-place rollback to a step held in memory reads no file."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest

from tests.integration.worker.conftest import Cluster, launch, rank_logs, record, tiny_spec, until_exited
from vigil import events as ev
from vigil.exits import EXIT_PARKED
from vigil_common import subjects
from vigil_trainer import checkpoint as ckpt

pytestmark = [pytest.mark.integration, pytest.mark.slow]

N = 2  # checkpoint.memory_every
SPEC = {"steps": 12, "checkpoint": {"every": 5, "keep": 5, "memory_every": N}}
CRASH = {"kind": "crash", "step": 9, "rank": 1, "exit_code": 7}  # after step 8: snapshot 8 is whole
_fault_free: dict[str, dict[tuple[int, int], float]] = {}


def shm(cluster: Cluster, node: int, job_id: str) -> Path:
    """A node's snapshot folder of the job (`tenancy.snapshot_dir`)."""
    return Path("/dev/shm") / f"vigil-{cluster.nodes()[node]}" / job_id


@pytest.fixture
def cleanup(ready_cluster: Cluster):
    jobs: list[str] = []
    yield jobs
    for job in jobs:
        for node in (0, 1):
            shutil.rmtree(shm(ready_cluster, node, job), ignore_errors=True)


def losses(rec: Any, attempt: int, steps: range) -> dict[tuple[int, int], float]:
    return {(e.rank, e.step): e.loss for e in rec.of(ev.StepCompleted, attempt=attempt) if e.step in steps}


async def fault_free(cluster: Cluster, bus: Any, job_id: str) -> dict[tuple[int, int], float]:
    """The losses of the same job without its fault (run once per module)."""
    if not _fault_free:
        async with record(bus, job_id) as rec:
            await bus.publish(subjects.launch(job_id), launch(cluster, job_id, tiny_spec(**SPEC)))
            exits = await until_exited(rec, timeout=240)
        assert {e.exit_code for e in exits.values()} == {0}, rank_logs(cluster, job_id)
        _fault_free.update(losses(rec, 1, range(12)))
    return _fault_free


async def crash_and_relaunch(cluster: Cluster, bus: Any, job_id: str, damage: Any) -> tuple[Any, int]:
    """Run the job until rank 1 crashes, `damage(job_id)` its snapshots, relaunch it as the scheduler
    does (attempt 2, from the newest disk checkpoint: step 5); the recorder and the step it resumed at."""
    spec = tiny_spec(**SPEC, faults=[CRASH])
    async with record(bus, job_id) as rec:
        await bus.publish(subjects.launch(job_id), launch(cluster, job_id, spec))
        first = await until_exited(rec, 1, timeout=240)
        assert first[1].exit_code == 7, rank_logs(cluster, job_id)
        assert max(e.step for e in rec.of(ev.StepCompleted, attempt=1, rank=1)) == 8
        damage(job_id)
        resume = str(ckpt.step_dir(cluster.checkpoint_root, job_id, 5))
        await bus.publish(
            subjects.launch(job_id), launch(cluster, job_id, spec, attempt=2, resume_from=resume)
        )
        second = await until_exited(rec, 2, timeout=240)
    assert {e.exit_code for e in second.values()} == {0}, rank_logs(cluster, job_id, tail=20_000)
    resumed = min(e.step for e in rec.of(ev.StepCompleted, attempt=2))
    return rec, resumed


async def test_a_crashed_rank_is_relaunched_from_its_peer_copy_and_trains_as_without_the_fault(
    ready_cluster, bus, job_id, cleanup
):
    cleanup += [job_id, job_id + "-free"]
    expected = await fault_free(ready_cluster, bus, job_id + "-free")

    def lose_own_copy(job: str) -> None:  # the node of rank 1 lost its memory of the job
        own = shm(ready_cluster, 1, job) / "world_2" / "rank_1"
        assert sorted(p.name for p in own.glob("*.json")) == ["step_00000006.json", "step_00000008.json"]
        shutil.rmtree(own)
        assert (shm(ready_cluster, 0, job) / "world_2" / "peer_1" / "step_00000008.json").is_file()

    rec, resumed = await crash_and_relaunch(ready_cluster, bus, job_id, lose_own_copy)
    assert resumed == 8  # not the disk checkpoint's 5: the snapshot of step 8, rank 1's from its peer
    # in-job restart: rank 0 failed its collective and parked; attempt 2 went on in its own process
    pids = {(e.attempt, e.rank): e.pid for e in rec.of(ev.RankStarted)}
    assert pids[(2, 0)] == pids[(1, 0)] and pids[(2, 1)] != pids[(1, 1)], pids
    assert {e.rank: e.exit_code for e in rec.of(ev.RankExited, attempt=1)} == {0: EXIT_PARKED, 1: 7}
    assert 9 - resumed <= N  # steps redone: those done since the snapshot
    logs = rank_logs(ready_cluster, job_id, tail=10**7)
    assert "rank 1 takes its snapshot of step 8 from rank 0" in logs
    got = losses(rec, 1, range(resumed)) | losses(rec, 2, range(resumed, 12))
    assert got.keys() == expected.keys()
    for key, loss in expected.items():
        assert got[key] == pytest.approx(loss, rel=1e-5), key
    # the job is done: its ranks removed their snapshots from both nodes' memory
    assert not list(shm(ready_cluster, 0, job_id).rglob("*.bin"))
    assert not list(shm(ready_cluster, 1, job_id).rglob("*.bin"))


async def test_a_corrupt_or_torn_snapshot_is_refused_and_the_next_whole_one_used(
    ready_cluster, bus, job_id, cleanup
):
    cleanup += [job_id, job_id + "-free"]
    expected = await fault_free(ready_cluster, bus, job_id + "-free")

    def damage(job: str) -> None:
        own = (
            shm(ready_cluster, 0, job) / "world_2" / "rank_0" / "step_00000008.bin"
        )  # rank 0's own copy: a flipped byte
        data = bytearray(own.read_bytes())
        data[len(data) // 2] ^= 0xFF
        own.write_bytes(bytes(data))
        torn = shm(ready_cluster, 1, job) / "world_2" / "peer_0" / "step_00000008.json"  # its peer copy: torn
        torn.unlink()

    rec, resumed = await crash_and_relaunch(ready_cluster, bus, job_id, damage)
    assert resumed == 6  # step 8 of rank 0 is whole nowhere: the snapshot before it
    logs = rank_logs(ready_cluster, job_id, tail=10**7)
    assert "refusing in-memory snapshot" in logs and "SHA-256" in logs
    got = losses(rec, 1, range(resumed)) | losses(rec, 2, range(resumed, 12))
    for key, loss in expected.items():
        assert got[key] == pytest.approx(loss, rel=1e-5), key


async def test_a_relaunch_with_no_whole_snapshot_loads_the_disk_checkpoint(
    ready_cluster, bus, job_id, cleanup
):
    cleanup.append(job_id)

    def wipe(job: str) -> None:
        manifests = [m for node in (0, 1) for m in shm(ready_cluster, node, job).glob("world_2/*/*.json")]
        assert len(manifests) == 8, manifests  # 2 nodes x (own + peer) x the newest 2 steps
        for manifest in manifests:
            manifest.write_text(json.dumps({"format": "vigil-snapshot/1"}))  # unreadable

    _, resumed = await crash_and_relaunch(ready_cluster, bus, job_id, wipe)
    assert resumed == 5  # the disk checkpoint's step
    logs = rank_logs(ready_cluster, job_id, tail=10**7)
    assert f"resumed from {ckpt.step_dir(ready_cluster.checkpoint_root, job_id, 5)} at step 5" in logs
    assert "unreadable" in logs


async def test_an_in_place_rollback_to_a_step_held_in_memory_reads_no_file(
    ready_cluster, bus, job_id, cleanup
):
    cleanup.append(job_id)
    root = ready_cluster.checkpoint_root
    spec = tiny_spec(steps=24, checkpoint={"every": 4, "keep": 10, "memory_every": N})
    async with record(bus, job_id) as rec:
        await bus.publish(subjects.launch(job_id), launch(ready_cluster, job_id, spec))
        await rec.until(lambda r: r.of(ev.StepCompleted, rank=0, step=9))
        await bus.publish(subjects.cmd(job_id), ev.HaltJob(job_id=job_id, attempt=1, reason="test"))
        halted = (await rec.until(lambda r: r.of(ev.RanksHalted)))[0]
        step8 = ckpt.step_dir(root, job_id, 8)
        victim = step8 / ckpt.DS_TAG / "mp_rank_00_model_states.pt"  # read, it would be refused
        data = bytearray(victim.read_bytes())
        data[len(data) // 2] ^= 0xFF
        victim.write_bytes(bytes(data))
        await bus.publish(
            subjects.cmd(job_id),
            ev.RollbackJob(job_id=job_id, attempt=1, checkpoint=str(step8), step=8, reason="test"),
        )
        done = (await rec.until(lambda r: r.of(ev.RollbackCompleted)))[0]
        exits = await until_exited(rec, timeout=240)
    assert {e.exit_code for e in exits.values()} == {0}, rank_logs(ready_cluster, job_id)
    assert done.to_step == 8 and Path(done.checkpoint) == step8  # not step 4, where the disk would go
    assert f"({step8}, from memory)" in rank_logs(ready_cluster, job_id, tail=10**7)
    assert not rec.of(ev.CheckpointRefused)
    # the steps run again after the rollback lose as they did the first time (the same state)
    first = {(e.rank, e.step): e.loss for e in rec.of(ev.StepCompleted) if e.generation == 0}
    again = {(e.rank, e.step): e.loss for e in rec.of(ev.StepCompleted) if e.generation == 1}
    redone = [k for k in first if k[1] >= 8]
    assert redone and halted.step >= 9
    for key in redone:
        assert again[key] == pytest.approx(first[key], rel=1e-5), key
