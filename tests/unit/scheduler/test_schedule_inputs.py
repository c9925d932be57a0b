"""What the placement pass reads of a stored spec: its time limit, or the operator's default."""

from __future__ import annotations

from vigil.spec import JobSpec
from vigil_scheduler.schedule_inputs import time_limit


def stored(**scheduling: object) -> dict:
    return JobSpec.model_validate({"name": "t", "scheduling": scheduling}).model_dump(mode="json")


def test_the_specs_time_limit_wins_over_the_default_and_none_means_no_limit() -> None:
    assert time_limit(stored(time_limit="1h30m"), default_s=600.0) == 5400.0
    assert time_limit(stored(preemptible=True), default_s=600.0) == 600.0
    assert time_limit(stored(), default_s=None) is None
