"""The built-in trainer relaunched cold (issue 39): a worker that keeps no warm ranks (`VIGIL_WARM_RANKS=0`)
starts each attempt's new ranks as new processes, which import torch and DeepSpeed and build the engine
before their first step (the crashed rank's partner parks and goes on in its own process: issue 40). A crash of rank 1 relaunches the job from its checkpoint; the guardian judges that
relaunch's start-up against the start-up limit, not against the attempt before's step times (which once
made any start-up longer than the 5 s floor a hang), and the job SUCCEEDS."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest

from tests.integration.guardian.test_e2e_ranks import TINY, TRAIN, Stack, train, whole_stack
from vigil.events import IncidentRaised, JobStateChanged, LaunchJob, RankExited, RankStarted, StepCompleted
from vigil.exits import EXIT_PARKED

pytestmark = [pytest.mark.integration, pytest.mark.slow]

STEPS, EVERY, CRASH_AT = 12, 3, 7  # checkpoints 3, 6, 9, 12: the relaunch resumes from 6


@pytest.fixture(scope="module")
async def stack(
    nats_url: str, database_url: str, tmp_path_factory: pytest.TempPathFactory
) -> AsyncIterator[Stack]:
    data_dir = tmp_path_factory.mktemp("cold")
    async with whole_stack(nats_url, database_url, data_dir, "cold", warm_ranks=0) as running:
        yield running


async def test_a_crash_relaunched_without_warm_ranks_succeeds(stack: Stack):
    run = await train(
        stack,
        {
            "name": "cold-relaunch",
            "resources": {"nodes": 1, "gpus_per_node": 2},
            "model": TINY,
            "train": {**TRAIN, "steps": STEPS},
            "checkpoint": {"every": EVERY, "memory_every": 0},  # from the disk checkpoint: a full load
            "faults": [{"kind": "crash", "step": CRASH_AT, "rank": 1, "exit_code": 7}],
        },
        timeout_s=300,
    )
    changes = run.of(JobStateChanged)
    hangs = [i.message for i in run.of(IncidentRaised) if i.kind == "hang"]
    assert changes[-1].to_state == "SUCCEEDED", ([(c.to_state, c.cause) for c in changes], hangs)
    assert hangs == []
    # rank 1 crashed; rank 0 failed its collective and parked (in-job restart: it goes on in its own
    # process), so the relaunch started rank 1 alone, cold
    failed = {(e.rank, e.exit_code) for e in run.of(RankExited) if e.attempt == 1 and e.exit_code}
    assert failed == {(1, 7), (0, EXIT_PARKED)}, failed
    started = {(e.attempt, e.rank): e.pid for e in run.of(RankStarted)}
    assert started[(2, 0)] == started[(1, 0)] and started[(2, 1)] != started[(1, 1)], started
    (relaunch,) = [launch for launch in run.of(LaunchJob) if launch.attempt == 2]
    assert (relaunch.resume_from or "").endswith("step_00000006"), relaunch.resume_from
    second = [e for e in run.of(StepCompleted) if e.attempt == 2]
    assert min(e.step for e in second) == 6 and max(e.step for e in second) == STEPS - 1
    first = min(e.occurred_at for e in second)
    print(f"\ncold relaunch: {(first - relaunch.occurred_at).total_seconds():.2f}s from launch to first step")
