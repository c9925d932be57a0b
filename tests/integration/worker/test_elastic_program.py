"""A program of its own in an elastic job (issue 40 §4): examples/byo/ddp_loop.py, a plain DDP loop, with
real workers (two nodes, CPU). Rank 1 crashes at step 12 (its node lost); the job goes on with 1 rank from
the checkpoint of step 10, then grows back to 2 from the checkpoint of step 15, as the scheduler places an
elastic job. The program learns its size from `run.on_resize`: on 1 rank it runs 2 micro-steps, each
reading a 2-rank batch, so every loss is the fault-free 2-rank run's (on 1 rank, the mean of its two
ranks'), up to the order of the sums."""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from typing import Any

import pytest
import yaml

from tests.integration.byo.ranks import EXAMPLES
from tests.integration.worker.conftest import (
    Cluster,
    launch,
    launch_on,
    rank_logs,
    record,
    start_worker,
    stop_worker,
    until_exited,
    wait_heartbeat,
)
from vigil import events as ev
from vigil_common import subjects
from vigil_trainer import checkpoint as ckpt

pytestmark = [pytest.mark.integration, pytest.mark.slow]

REL = 1e-4


@pytest.fixture(scope="module")
def code_cluster(nats_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    """Two workers whose code root holds the examples."""
    code = tmp_path_factory.mktemp("code")
    shutil.copytree(EXAMPLES, code / "byo", ignore=shutil.ignore_patterns("*.yaml", "*.md", "out"))
    data_dir = tmp_path_factory.mktemp("elastic-program")
    roots = json.dumps([str(code)])
    workers = [
        start_worker(nats_url, data_dir, f"ddp-{x}-{data_dir.name[-6:]}", 1, VIGIL_CODE_ROOTS=roots)
        for x in "ab"
    ]
    try:
        yield Cluster(data_dir=data_dir, workers=workers)
    finally:
        for w in workers:
            stop_worker(w)


def ddp_spec(steps: int, crash_at: int | None = None) -> dict[str, Any]:
    spec = yaml.safe_load((EXAMPLES / "ddp_loop.yaml").read_text())
    argv = ["python", "ddp_loop.py", "--steps", str(steps), "--save-every", "5"]
    spec["entrypoint"]["argv"] = argv + (["--crash-at", str(crash_at)] if crash_at is not None else [])
    spec["resources"] = {"nodes": 2, "gpus_per_node": 1, "elastic": {"min_nodes": 1}}
    spec["train"]["steps"] = steps
    spec["checkpoint"] = {"every": 5, "keep": 10}
    return spec


def losses(rec: Any, attempt: int) -> dict[tuple[int, int], float]:
    return {(e.rank, e.step): e.loss for e in rec.of(ev.StepCompleted, attempt=attempt)}


async def test_a_ddp_program_shrinks_and_grows_back_with_the_fault_free_losses(code_cluster, bus, job_id):
    for w in code_cluster.workers:
        await wait_heartbeat(bus, w.node)
    free, job = f"{job_id}-free", job_id
    async with record(bus, free) as rec:
        await bus.publish(subjects.launch(free), launch(code_cluster, free, ddp_spec(20)))
        done = await until_exited(rec, timeout=240)
    assert {e.exit_code for e in done.values()} == {0}, rank_logs(code_cluster, free)
    expected = losses(rec, 1)
    assert len(expected) == 40

    a = code_cluster.nodes()[0]
    root = code_cluster.checkpoint_root
    async with record(bus, job) as rec:
        await bus.publish(subjects.launch(job), launch(code_cluster, job, ddp_spec(20, crash_at=12)))
        first = await until_exited(rec, 1, timeout=240)
        assert {e.exit_code for e in first.values()} != {0}, rank_logs(code_cluster, job)

        alone = [ev.RankPlacement(rank=0, node=a, device=0, local_rank=0)]  # shrunk: node a alone
        resume = str(ckpt.step_dir(root, job, 10))
        await bus.publish(
            subjects.launch(job), launch_on(alone, job, ddp_spec(15), attempt=2, resume_from=resume)
        )
        await rec.until(lambda r: len(r.exits(2)) == 1, 240, fail_on_exit=False)
        assert rec.exits(2)[0].exit_code == 0, rank_logs(code_cluster, job)

        resume = str(ckpt.step_dir(root, job, 15))  # grown back: both nodes
        await bus.publish(
            subjects.launch(job), launch(code_cluster, job, ddp_spec(20), attempt=3, resume_from=resume)
        )
        third = await until_exited(rec, 3, timeout=240)
    logs = rank_logs(code_cluster, job, tail=10**6)
    assert {e.exit_code for e in third.values()} == {0}, logs
    assert "1 ranks, the spec's 2: 2 micro-steps each keep its global batch" in logs

    shrunk = losses(rec, 2)
    assert sorted(shrunk) == [(0, s) for s in range(10, 15)]
    for (_, step), loss in shrunk.items():
        assert loss == pytest.approx((expected[(0, step)] + expected[(1, step)]) / 2, rel=REL), step
    grown = losses(rec, 3)
    assert sorted(grown) == [(r, s) for r in (0, 1) for s in range(15, 20)]
    for key, loss in grown.items():
        assert loss == pytest.approx(expected[key], rel=REL), key


async def test_a_hugging_face_trainer_is_relaunched_at_the_new_size_from_its_own_checkpoint(
    code_cluster, bus, job_id
):
    """The Trainer cannot re-form its ranks in place: the job is relaunched on 1 rank from the Trainer's
    checkpoint of step 10, with twice the gradient accumulation (`run.on_resize`), and trains to the end."""
    for w in code_cluster.workers:
        await wait_heartbeat(bus, w.node)
    spec = yaml.safe_load((EXAMPLES / "hf_trainer.yaml").read_text())
    spec["entrypoint"]["argv"] = [
        "python",
        "hf_trainer.py",
        "--steps",
        "16",
        "--save-every",
        "5",
        "--crash-at",
        "12",
    ]
    spec["resources"] = {"nodes": 2, "gpus_per_node": 1, "elastic": {"min_nodes": 1}}
    spec["train"]["steps"] = 16
    spec["checkpoint"] = {"every": 5, "keep": 10}
    a = code_cluster.nodes()[0]
    async with record(bus, job_id) as rec:
        await bus.publish(subjects.launch(job_id), launch(code_cluster, job_id, spec))
        first = await until_exited(rec, 1, timeout=300)
        assert {e.exit_code for e in first.values()} != {0}, rank_logs(code_cluster, job_id)
        alone = [ev.RankPlacement(rank=0, node=a, device=0, local_rank=0)]
        resume = str(ckpt.step_dir(code_cluster.checkpoint_root, job_id, 10))
        await bus.publish(
            subjects.launch(job_id), launch_on(alone, job_id, spec, attempt=2, resume_from=resume)
        )
        await rec.until(lambda r: len(r.exits(2)) == 1, 300, fail_on_exit=False)
    logs = rank_logs(code_cluster, job_id, tail=10**6)
    assert rec.exits(2)[0].exit_code == 0, logs
    assert "1 ranks, the spec's 2: 2 micro-steps each keep its global batch" in logs
    assert sorted(e.step for e in rec.of(ev.StepCompleted, attempt=2)) == list(range(10, 16))
