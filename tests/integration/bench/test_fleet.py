"""`vigil bench fleet` end to end at two small sizes: real service processes with their NATS roles, simulated
nodes placed through the gateway, probes answered, a cost line per service and the sizing table; the JSON
contract on the last line. No speed asserted."""

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
        "VIGIL_BENCH_FLEET_SIZES": "2,3",
        "VIGIL_BENCH_FLEET_SECONDS": "6",
        "VIGIL_BENCH_FLEET_TELEMETRY": "2",
    }
    vigil = str(Path(sys.executable).parent / "vigil")
    out = subprocess.run([vigil, "bench", "fleet"], env=env, capture_output=True, text=True, timeout=400)
    assert out.returncode == 0, out.stderr[-3000:]
    res = json.loads(out.stdout.strip().splitlines()[-1])
    assert res["bench"] == "fleet" and res["nodes"] == 3 and res["telemetry_replicas"] == 2
    assert res["probes_load"] > 0 and res["probes_load_missed"] == 0
    assert res["stored_step_events_per_s"] > 0
    assert [s["jobs"] for s in res["simulators"]] == [2, 1]  # one simulator per size, for the nodes it added
    assert {
        "scheduler",
        "guardian-0",
        "guardian-1",
        "telemetry-0",
        "telemetry-1",
        "postgres",
        "nats-server",
    } <= set(res["cpu_s_under_load"])
    # two guardians (the default) divided the shares; each judged the events its shares were offered. Jobs
    # fall into shares by a hash of their random ids: 3 jobs and a few probes all in one guardian's shares
    # happen (1 CI run in ~30), and then the other is rightly offered nothing.
    judged, offered = res["events_per_s_by_guardian"], res["offered_per_s_by_guardian"]
    assert res["guardians"] == 2 and len(judged) == 2 and judged.keys() == offered.keys(), (judged, offered)
    assert sum(offered.values()) > 0 and sum(judged.values()) > 0, (judged, offered)
    assert all(judged[who] > 0 for who, rate in offered.items() if rate > 0), (judged, offered)
    # what holds it back: every durable's backlog and every process's CPU through the run
    assert "telemetry-steps" in res["consumers"] and any(c.startswith("guardian") for c in res["consumers"])
    assert isinstance(res["holding_back"], list) and res["timeline"]
    assert "telemetry-0" in res["timeline"][-1]["cpu"]
    # each size measured; the latency figure at the largest one within the busy share
    assert [s["ranks"] for s in res["sizes"]] == [16, 24] and res["ranks"] == 24
    assert all(s["probes"] > 0 and s["probes_missed"] == 0 for s in res["sizes"])
    assert res["busy"] <= res["busy_target"] * 1.1 and res["busy_target"] == 0.6
    assert res["busy"] == res["sizes"][-1]["busy"] and res["backlog_growing"] == []
    # a line per service: per 1,000 ranks and a fixed cost, through the two sizes
    for name in (
        "nats-server",
        "guardian-0",
        "guardian-1",
        "guardians",
        "telemetry",
        "postgres",
        "scheduler",
    ):
        line = res["costs"][name]
        assert set(line) == {"per_1000_ranks", "fixed", "worst_residual", "measured"}, name
        assert list(line["measured"]) == ["16", "24"] and line["measured"]["24"] > 0, (name, line)
    assert "simulator" not in res["costs"] and res["simulator_cost"]["measured"]["24"] > 0
    assert res["bench_cost"] is not None and res["total_cost"]["per_1000_ranks"] == pytest.approx(
        sum(res["costs"][n]["per_1000_ranks"] for n in res["costs"] if not n.startswith("guardian-"))
        + res["simulator_cost"]["per_1000_ranks"]
        + res["bench_cost"]["per_1000_ranks"],
        abs=1e-3,
    )
    # cores at 1k, 10k and 100k GPUs, each beyond the measured 24 ranks: extrapolated
    assert set(res["sizing"]) == {"nats-server", "guardians", "telemetry", "postgres", "scheduler"}
    assert all(
        set(row) == {"1000", "10000", "100000"} and all(c["how"] == "extrapolated" for c in row.values())
        for row in res["sizing"].values()
    ), res["sizing"]
    assert res["stress"] is None and res["grow_failed"] == []  # stress only with VIGIL_BENCH_FLEET_STRESS=1
    # the store's own latency beside the guardian's: a step's publish until VIGIL_JOBS acknowledged it
    assert all(s["stages"]["stored_p99_ms"] > 0 for s in res["sizes"]) and res["stages_load"]["judge_p99_ms"]
    took = res["took_s"]
    assert {"start the services", "idle probes", "grow to 2 nodes", "measure 3 nodes", "total"} <= set(took)
    # the human tables before the JSON
    assert "per 1,000 ranks at 1 step/s" in out.stdout and "| nats-server |" in out.stdout
    assert "fleet: measure 3 nodes:" in out.stderr
