"""Each example of examples/byo/ as a two-rank job through the whole stack (scheduler and gateway,
telemetry, guardian and a worker in one process; real NATS and Postgres), its own program started from a
code root with a NaN on rank 1 at a known step: the guardian names rank 1, the job recovers (the Trainer
and Lightning by a relaunch from the checkpoint, DeepSpeed and DDP loops in place) and succeeds, and
every step is stored once. And each of the four integrations crashed once mid-run, its relaunch slow to
start: relaunched from its checkpoint, it succeeds (issue 39)."""

from __future__ import annotations

import math
import shutil
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.integration.byo.ranks import EXAMPLES
from tests.integration.guardian.test_e2e_ranks import Stack, train, whole_stack
from vigil.events import (
    CheckpointSaved,
    IncidentRaised,
    JobStateChanged,
    LaunchJob,
    RankExited,
    RestartRequested,
    RollbackCompleted,
    StepCompleted,
)
from vigil.manifest import MANIFEST
from vigil_common import readmodel, subjects

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.byo]

STEPS, EVERY, NAN_AT = 16, 4, 9  # checkpoints 4, 8, 12, 16; the rollback goes to 8


@pytest.fixture(scope="module")
async def stack(
    nats_url: str, database_url: str, tmp_path_factory: pytest.TempPathFactory
) -> AsyncIterator[Stack]:
    code = tmp_path_factory.mktemp("code")
    shutil.copytree(EXAMPLES, code / "byo", ignore=shutil.ignore_patterns("*.yaml", "*.md", "out"))
    data_dir = tmp_path_factory.mktemp("byo")
    async with whole_stack(nats_url, database_url, data_dir, "byo", code_roots=[code]) as running:
        yield running


def example_spec(name: str, **faults: float | None) -> dict[str, Any]:
    """examples/byo/<name>.yaml, shortened: STEPS steps, a checkpoint every EVERY, the NaN at NAN_AT; or
    the faults given (`nan_at`, `crash_at`, `startup_delay`: faults.py's flags; None leaves one out)."""
    spec = yaml.safe_load((EXAMPLES / f"{name}.yaml").read_text())
    argv = spec["entrypoint"]["argv"]
    for flag, value in (("--steps", STEPS), ("--save-every", EVERY)):
        argv[argv.index(flag) + 1] = str(value)
    del argv[argv.index("--nan-at") : argv.index("--nan-at") + 2]
    for name_, value in ({"nan_at": NAN_AT} | faults).items():
        if value is not None:
            argv += [f"--{name_.replace('_', '-')}", str(value)]
    spec["train"]["steps"] = STEPS
    spec["checkpoint"]["every"] = EVERY
    spec["checkpoint"]["keep"] = 10
    spec["name"] = f"{spec['name']}-{uuid.uuid4().hex[:4]}"
    return spec


def checkpoint_before_nan(run: Any, step: int) -> int:
    """`step` (the rollback's target), once checked to be a checkpoint saved of a step before the NaN's.
    The guardian takes the newest one it has read when it judges the NaN, but it reads the saves (status
    events) and the steps on two consumers: rank 0's save of step 8 may be unread when rank 1's NaN at
    step 9 is judged (fast steps; a loaded machine, seen beside `stress --cpu 2`), and the rollback then
    goes to step 4, as it should with what the guardian knows."""
    saved = sorted({e.step for e in run.of(CheckpointSaved) if e.step < NAN_AT})
    assert step in saved, (step, saved)
    return step


RELAUNCHED = {"hf_trainer", "hf_deepspeed", "lightning_ddp"}  # cannot load a checkpoint in place
CRASH_AT = 10  # after the checkpoint of 8: the relaunch resumes from it
# Longer than the hang detector's 5 s floor, which judged a relaunch's start-up by the step times it kept
# from the attempt before: every relaunch of a program slower to start than that was "hung" (issue 39).
STARTUP_DELAY_S = 8.0


@pytest.mark.parametrize(
    "example", ["hf_trainer", "hf_deepspeed", "lightning_ddp", "deepspeed_loop", "ddp_loop"]
)
async def test_an_example_with_a_nan_on_rank_1_recovers_and_succeeds(stack: Stack, example: str):
    # the HF Trainer, which survives a NaN only by a relaunch from its checkpoint, starts its relaunch
    # slowly, as a large model's program does: the relaunch's start-up is no hang (issue 39)
    delay = STARTUP_DELAY_S if example == "hf_trainer" else None
    run = await train(stack, example_spec(example, startup_delay=delay), timeout_s=420)
    states = [e.to_state for e in run.of(JobStateChanged)]
    assert states[-1] == "SUCCEEDED", states
    (nan,) = [i for i in run.of(IncidentRaised) if i.kind == "nan"]
    assert (nan.rank, nan.step, nan.action) == (1, NAN_AT, "rollback")
    repeated: list[int] = []  # the steps run twice (an in-place rollback)
    if run.of(JobStateChanged)[-1].cause.startswith("the ranks finished before the rollback reached them"):
        # fast steps may all run before the halt reaches the ranks (issue 32): the update was skipped,
        # so the job SUCCEEDS with nothing to redo (once, this left the job ROLLING_BACK for good)
        assert "never applied" in run.of(JobStateChanged)[-1].cause
        assert {launch.attempt for launch in run.of(LaunchJob)} == {1}
    elif example in RELAUNCHED:  # no loader: every rank stopped, the job relaunched from the checkpoint
        (restart,) = run.of(RestartRequested)
        target = checkpoint_before_nan(run, restart.step)
        relaunch = [launch for launch in run.of(LaunchJob) if launch.attempt == 2]
        assert relaunch and (relaunch[0].resume_from or "").endswith(f"step_{target:08d}")
        assert max(e.step for e in run.of(StepCompleted) if e.attempt == 2) == STEPS - 1
    else:  # loaded in place, the same attempt going on
        (done,) = run.of(RollbackCompleted)
        target = checkpoint_before_nan(run, done.to_step)
        assert done.from_step >= NAN_AT, done
        assert {e.attempt for e in run.of(StepCompleted)} == {1}
        # the program's Run numbers its runs of the steps: 0 before the rollback, 1 for the re-run
        sent = run.of(StepCompleted)
        assert {e.generation for e in sent if e.occurred_at < done.occurred_at} == {0}
        assert {e.generation for e in sent if e.occurred_at > done.occurred_at} == {1}
        first = {(e.rank, e.step) for e in sent if e.generation == 0}
        rerun = {(e.rank, e.step): e.loss for e in sent if e.generation == 1}
        repeated = sorted({s for r, s in rerun if (r, s) in first})
        assert repeated[0] == target and NAN_AT in repeated, repeated
    last = max(e.attempt for e in run.of(StepCompleted))
    after = [e for e in run.of(StepCompleted) if e.step > NAN_AT and e.attempt == last]
    assert after and all(math.isfinite(e.loss) for e in after)
    saved = run.of(CheckpointSaved)
    assert {c.step for c in saved} >= {4, 8, 12, 16}
    assert all((Path(c.path) / MANIFEST).is_file() for c in saved if c.step == 16)
    # one aggregate per (attempt, step), every rank's newest event in it: every step of the run is there
    steps = await readmodel.steps(stack.pool, run.job_id, aggregate=True, limit=100)
    pairs = [(s["attempt"], s["step"]) for s in steps["items"]]
    assert len(pairs) == len(set(pairs)) and {k for _, k in pairs} == set(range(STEPS)), pairs
    assert all(s["ranks"] == 2 for s in steps["items"]), steps["items"]
    if example not in RELAUNCHED:  # the aggregate of a step run twice is its re-run's
        for item in steps["items"]:
            if item["step"] in repeated:
                assert item["generation"] == 1, item
                mean = (rerun[(0, item["step"])] + rerun[(1, item["step"])]) / 2
                assert item["loss"] == pytest.approx(mean, rel=1e-6), item


async def test_a_nan_on_the_very_last_step_of_a_user_program_succeeds(stack: Stack):
    """Issue 32 (4 of 4 stuck ROLLING_BACK on their slots): the NaN is on the last step, so the ranks exit
    before the guardian's halt and rollback reach them. The program skipped the update (`run.agree`), so
    the job SUCCEEDS, with an incident saying so when the rollback was outrun, or after rolling back in
    place when it was not."""
    spec = example_spec("ddp_loop")
    argv = spec["entrypoint"]["argv"]
    argv[argv.index("--nan-at") + 1] = str(STEPS - 1)
    run = await train(stack, spec, timeout_s=240)  # well inside the sweeper's 300 s bound
    changes = run.of(JobStateChanged)
    assert changes[-1].to_state == "SUCCEEDED", [(c.to_state, c.cause) for c in changes]
    (nan,) = [i for i in run.of(IncidentRaised) if i.kind == "nan"]
    assert (nan.rank, nan.step, nan.action) == (1, STEPS - 1, "rollback")
    assert nan.evidence["skipped"] is True
    ended = changes[-1].cause
    if ended.startswith("the ranks finished before the rollback reached them"):
        # the ranks were gone when the rollback came: no relaunch, as the update was never applied
        assert "never applied" in ended, ended
        async with stack.bus.watch(subjects.incident(run.job_id), from_start=True) as incidents:
            while (
                not isinstance(said := await incidents.next(10), IncidentRaised) or said.kind != "lifecycle"
            ):
                assert said is not None, "no lifecycle incident"
        assert said.action == "alert" and "never applied" in said.message, said
    else:  # both ranks exited before the halt, or the rollback reached them in time
        assert ended == "all 2 ranks exited 0", ended
    assert {launch.attempt for launch in run.of(LaunchJob)} == {1}
    job = (await stack.http.get(f"/api/v1/jobs/{run.job_id}")).json()
    assert [r["exit_code"] for r in job["ranks"]] == [0, 0], job["ranks"]


# Two programs, one of each way back: the HF Trainer relaunched from its own checkpoint, and the plain DDP
# loop from the SDK's (Lightning's relaunch and the DeepSpeed loop's load run in the NaN test above); the
# start-up judge they test is the guardian's, the same for every program. 30 s each: CI keeps its time.
@pytest.mark.parametrize("example", ["hf_trainer", "ddp_loop"])
async def test_an_example_crashed_once_mid_run_and_slow_to_start_is_relaunched_and_succeeds(
    stack: Stack, example: str
):
    """Rank 1 dies at step CRASH_AT (exit code 17), and every rank of the relaunch takes STARTUP_DELAY_S
    before it starts (the imports and loads of a large model). The scheduler relaunches the job from the
    checkpoint of step 8; the guardian judges the relaunch's start-up against the start-up limit, not the
    attempt before's step times; the job trains to the end and SUCCEEDS, with no hang incident."""
    spec = example_spec(example, nan_at=None, crash_at=CRASH_AT, startup_delay=STARTUP_DELAY_S)
    run = await train(stack, spec, timeout_s=420)
    changes = run.of(JobStateChanged)
    hangs = [i.message for i in run.of(IncidentRaised) if i.kind == "hang"]
    assert changes[-1].to_state == "SUCCEEDED", ([(c.to_state, c.cause) for c in changes], hangs)
    assert hangs == []
    crashed = [e for e in run.of(RankExited) if e.attempt == 1 and e.rank == 1]
    assert [e.exit_code for e in crashed] == [17], crashed
    assert f"rank 1 crashes at step {CRASH_AT}" in crashed[0].log_tail, crashed[0].log_tail
    (relaunch,) = [launch for launch in run.of(LaunchJob) if launch.attempt == 2]
    assert (relaunch.resume_from or "").endswith("step_00000008"), relaunch.resume_from
    second = [e for e in run.of(StepCompleted) if e.attempt == 2]
    assert min(e.step for e in second) == 8 and max(e.step for e in second) == STEPS - 1
    # the relaunch was slower to its first step than the floor that once judged it hung
    first = min(e.occurred_at for e in second)
    assert (first - relaunch.occurred_at).total_seconds() >= STARTUP_DELAY_S
    assert {launch.attempt for launch in run.of(LaunchJob)} == {1, 2}
    steps = await readmodel.steps(stack.pool, run.job_id, aggregate=True, limit=100)
    pairs = [(s["attempt"], s["step"]) for s in steps["items"]]
    assert len(pairs) == len(set(pairs)) and {k for _, k in pairs} == set(range(STEPS)), pairs
