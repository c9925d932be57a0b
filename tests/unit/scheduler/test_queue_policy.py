"""VIGIL_QUEUE_POLICY: `fair` (the default) orders by fair share and backfills behind a blocked head;
`strict` (the placement pass's `STRICT` inputs) orders by priority then submission and lets a blocked head
hold up the queue, as the pass did before issue 41."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from vigil.spec import JobSpec
from vigil_common.settings import Settings
from vigil_scheduler.backfill import Running
from vigil_scheduler.fairshare import Standing
from vigil_scheduler.placement import Inventory, NodeState, PlacementRequest, Slot, plan
from vigil_scheduler.schedule_inputs import STRICT, Inputs

NOW = 1_000_000.0
# one 4-device node; "r" runs on 2 of its devices and ends within the hour
CLUSTER = Inventory(
    (
        NodeState(
            name="a",
            devices=tuple(
                Slot(index=i, job_id="r" if i < 2 else None, reported_free=i >= 2) for i in range(4)
            ),
        ),
    )
)
FAIR = Inputs(
    now=NOW,
    running=(Running("r", frozenset({("a", 0), ("a", 1)}), NOW + 3600),),
    standing={
        "heavy": Standing("heavy", share=0.5, usage=0.9, gpu_hours=9.0),
        "light": Standing("light", share=0.5, usage=0.1, gpu_hours=1.0),
    },
    default_limit_s=None,
)


def spec(limit: str | None = None) -> dict:
    scheduling = {"time_limit": limit} if limit else {}
    return JobSpec.model_validate({"name": "t", "scheduling": scheduling}).model_dump(mode="json")


def queue(inputs: Inputs) -> list[PlacementRequest]:
    """A head that needs the whole node (blocked), then a short 2-device job of the team over its share,
    then one of the team under it."""
    asks = [("head", 4, "light", None), ("short", 2, "heavy", "10m"), ("later", 2, "light", "10m")]
    return [
        inputs.request(PlacementRequest(job_id=j, world_size=n, max_nodes=1, seq=i, team=t), spec(limit))
        for i, (j, n, t, limit) in enumerate(asks)
    ]


def test_the_policy_is_fair_unless_set_strict_and_nothing_else() -> None:
    assert Settings().queue_policy == "fair"
    assert Settings(queue_policy="strict").queue_policy == "strict"
    with pytest.raises(ValidationError, match="queue_policy"):
        Settings(queue_policy="fifo")


def test_fair_backfills_behind_the_blocked_head_the_team_under_its_share_first() -> None:
    backfill = FAIR.backfill()
    placed, _ = plan(queue(FAIR), CLUSTER, backfill=backfill)
    assert [p.job_id for p in placed] == ["later"]  # light's factor is higher: it goes ahead of heavy's
    assert backfill.reservation is not None and backfill.reservation.request.job_id == "head"


def test_strict_lets_the_blocked_head_hold_up_everyone_behind_it() -> None:
    requests = queue(STRICT)
    assert [r.share_factor for r in requests] == [1.0] * 3  # no fair share
    backfill = STRICT.backfill()  # no running job's end known: the head gets no reservation time
    placed, _ = plan(requests, CLUSTER, backfill=backfill)
    assert placed == [] and backfill.reservation is not None and backfill.reservation.start is None
    without_head, _ = plan(requests[1:], CLUSTER, backfill=STRICT.backfill())
    assert [p.job_id for p in without_head] == ["short"]  # submission order: heavy's job first
