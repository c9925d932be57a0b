"""`vigil bench fleet` end to end at a small size: real service processes with their NATS roles, simulated
nodes placed through the gateway, probes answered; the JSON contract on the last line. No speed asserted."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.integration, pytest.mark.slow]


def test_a_small_fleet_runs_and_reports() -> None:
    env = {
        **{k: v for k, v in os.environ.items() if k not in ("VIGIL_NATS_URL", "VIGIL_DATABASE_URL")},
        "VIGIL_BENCH_FLEET_NODES": "3",
        "VIGIL_BENCH_FLEET_SECONDS": "8",
        "VIGIL_BENCH_FLEET_SIMULATORS": "1",
        "VIGIL_BENCH_FLEET_TELEMETRY": "2",
    }
    vigil = str(Path(sys.executable).parent / "vigil")
    out = subprocess.run([vigil, "bench", "fleet"], env=env, capture_output=True, text=True, timeout=400)
    assert out.returncode == 0, out.stderr[-3000:]
    res = json.loads(out.stdout.strip().splitlines()[-1])
    assert res["bench"] == "fleet" and res["nodes"] == 3 and res["telemetry_replicas"] == 2
    assert res["probes_load"] > 0 and res["probes_load_missed"] == 0
    assert res["stored_step_events_per_s"] > 0 and res["simulators"][0]["jobs"] == 3
    assert {
        "scheduler",
        "guardian-0",
        "guardian-1",
        "telemetry-0",
        "telemetry-1",
        "postgres",
        "nats-server",
    } <= set(res["cpu_s_under_load"])
    # two guardians (the default) divided the shares; each judged its jobs' events
    assert res["guardians"] == 2 and len(res["events_per_s_by_guardian"]) == 2, res[
        "events_per_s_by_guardian"
    ]
    assert all(rate > 0 for rate in res["events_per_s_by_guardian"].values()), res["events_per_s_by_guardian"]
    # what holds it back: every durable's backlog and every process's CPU through the run
    assert "telemetry-steps" in res["consumers"] and any(c.startswith("guardian") for c in res["consumers"])
    assert isinstance(res["holding_back"], list) and res["timeline"]
    assert "telemetry-0" in res["timeline"][-1]["cpu"]
