"""Held steps through the whole stack (scheduler, telemetry, guardian, a worker of three CPU slots) with
real DeepSpeed ranks: two transient faults on one device exclude it (marked unhealthy with its evidence,
the job relaunched on the others, and it SUCCEEDS); a step that is bad again right after its data was
skipped is the parameters' fault, and is rolled back as before."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest

from tests.integration.guardian.test_e2e_ranks import TINY, TRAIN, Stack, train, whole_stack
from vigil.events import (
    IncidentRaised,
    JobStateChanged,
    LaunchJob,
    RestartJob,
    RollbackCompleted,
    StepCompleted,
    StepReplayed,
)

pytestmark = [pytest.mark.integration, pytest.mark.slow]


@pytest.fixture(scope="module")
async def stack3(
    nats_url: str, database_url: str, tmp_path_factory: pytest.TempPathFactory
) -> AsyncIterator[Stack]:
    data = tmp_path_factory.mktemp("e2e-replay")
    async with whole_stack(nats_url, database_url, data, "replay", cpu_slots=3) as running:
        yield running


async def test_two_transient_faults_on_one_device_exclude_it_and_the_job_succeeds(stack3: Stack):
    run = await train(
        stack3,
        {
            "name": "e2e-sdc",
            "resources": {"nodes": 1, "gpus_per_node": 2},
            "model": TINY,
            "train": {**TRAIN, "steps": 12},
            "checkpoint": {"every": 3},
            "guardian": {"sdc_strikes": 2},
            "faults": [{"kind": "sdc", "step": 2, "rank": 1}, {"kind": "sdc", "step": 7, "rank": 1}],
        },
    )
    assert run.of(JobStateChanged)[-1].to_state == "SUCCEEDED"
    first = run.of(LaunchJob)[0]
    sick = next((p.node, p.device) for p in first.placement if p.rank == 1)
    replays = run.of(StepReplayed)
    assert [(r.step, r.outcome) for r in replays] == [(2, "transient"), (7, "transient")]
    incidents = run.of(IncidentRaised)
    strikes = [i for i in incidents if i.action == "replay"]
    assert [(i.step, i.rank, (i.node, i.device)) for i in strikes] == [(2, 1, sick), (7, 1, sick)]
    assert "replay clean" in strikes[0].message
    (sdc,) = [i for i in incidents if i.kind == "sdc"]
    assert (sdc.node, sdc.device, sdc.action) == (*sick, "restart") and sdc.evidence["strikes"] == [2, 7]
    (restart,) = run.of(RestartJob)
    assert restart.unhealthy == [sick] and restart.step == 6
    relaunch = [launch for launch in run.of(LaunchJob) if launch.attempt == 2]
    assert relaunch and sick not in {(p.node, p.device) for p in relaunch[0].placement}
    assert max(e.step for e in run.of(StepCompleted) if e.attempt == 2) == 11
    # the inventory says why: what `vigil gpus` and the console show
    gpus = (await stack3.http.get("/api/v1/gpus")).json()["items"]
    (marked,) = [g for g in gpus if (g["node"], g["index"]) == sick]
    assert not marked["healthy"] and "silent data corruption" in marked["unhealthy_reason"]
    assert "steps 2, 7" in marked["unhealthy_reason"]
    assert sum(g["healthy"] for g in gpus if g["node"] == stack3.node) == 2


async def test_a_step_bad_again_right_after_its_data_was_skipped_is_rolled_back(stack3: Stack):
    run = await train(
        stack3,
        {
            "name": "e2e-after-skip",
            "resources": {"nodes": 1, "gpus_per_node": 2},
            "model": TINY,
            "train": {**TRAIN, "steps": 10},
            "checkpoint": {"every": 3, "keep": 10},
            "faults": [
                {"kind": "nan", "step": 5, "rank": 1},  # in the data step 5 reads (5): reproduced
                {"kind": "nan", "step": 5, "rank": 1, "data_position": 6},  # and in the next (6)
            ],
        },
    )
    assert run.of(JobStateChanged)[-1].to_state == "SUCCEEDED"
    incidents = run.of(IncidentRaised)
    assert [(i.kind, i.action, i.step) for i in incidents if i.kind == "nan"] == [
        ("nan", "skip", 5),  # held: data 5 skipped
        ("nan", "rollback", 5),  # bad again on data 6: the parameters, rolled back past data 6
        ("nan", "skip", 5),  # after the rollback, data 5 again: held, skipped again
    ]
    (done,) = run.of(RollbackCompleted)
    assert done.to_step == 3 and done.skip_data == (6, 7)
    final = {e.step: e for e in run.of(StepCompleted) if e.rank == 0 and e.occurred_at > done.occurred_at}
    assert final[5].data_position == 7 and max(final) == 9 and not final[5].skipped
