"""`vigil bench elastic` (issue 40 §5) once, with small sizes: its JSON line has the three paths, and each path
recovered from the lost host (a first step after the kill, steps redone counted, a goodput). No timing is
asserted: speed is the bench's to report, not a test's to hold."""

from __future__ import annotations

import json
import math

import pytest

from vigil_bench.elastic import PATHS, measure
from vigil_bench.hosts import cannot_make_hosts
from vigil_common.settings import Settings

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.multihost]


async def test_the_elastic_bench_reports_each_path_recovered(capsys: pytest.CaptureFixture[str]) -> None:
    if reason := cannot_make_hosts():
        pytest.skip(reason)
    out = await measure(Settings.load(), steps=16, kill_at=6, requeue_after_s=1.0, warmup_steps=0)
    json.loads(json.dumps(out))  # one JSON line, as `vigil bench` prints it
    assert out["bench"] == "elastic"
    assert set(out["paths"]) == set(PATHS)
    for name, path in out["paths"].items():
        assert {"detect_s", "first_step_s", "steps_redone", "goodput"} <= set(path), name
        assert math.isfinite(path["first_step_s"]) and path["first_step_s"] > 0, (name, path)
        assert path["steps_redone"] >= 0, (name, path)
        assert 0 < path["goodput"] <= 1, (name, path)
        assert path["detect_s"] is not None, (name, path)
    assert out["ratio"] == out["paths"]["spare"]["goodput"]
    assert out["paths"]["elastic"]["ranks_after"] == 1  # shrunk to hosta
    assert "hostc" in out["paths"]["spare"]["placed_on"]
    assert "path" in capsys.readouterr().out  # the table, before the JSON line
