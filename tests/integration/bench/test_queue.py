"""`vigil bench queue` on a small seeded trace (8 nodes, 40 trace minutes at a quarter second each): both
policies through real scheduler processes, Postgres and NATS; the JSON contract, a PNG and a table. Sane
values, not the targets (those are the default run's): every utilization a share, the strict policy never
preempting, no step lost to a preemption, every job of the trace submitted to both."""

from __future__ import annotations

import pytest

from vigil_bench import queue
from vigil_bench.queue_trace import trace
from vigil_common.settings import Settings

pytestmark = pytest.mark.integration

SMALL = {
    "VIGIL_BENCH_QUEUE_NODES": "8",
    "VIGIL_BENCH_QUEUE_MINUTES": "40",
    "VIGIL_BENCH_QUEUE_SECONDS_PER_MINUTE": "0.25",
    "VIGIL_BENCH_QUEUE_DRAIN_MINUTES": "8",
    "VIGIL_BENCH_QUEUE_SEED": "3",
}


async def test_a_small_trace_runs_under_both_policies_and_reports(tmp_path, monkeypatch, capsys) -> None:
    for name, value in SMALL.items():
        monkeypatch.setenv(name, value)
    out = await queue.run(Settings.load(data_dir=tmp_path))

    assert out["bench"] == "queue" and out["value"] == out["utilization"]
    assert out["floor"] == out["utilization_strict"]
    for key in ("utilization", "utilization_strict"):
        assert 0.0 < out[key] <= 1.0, (key, out[key])
    assert out["small_p95_wait_ratio"] is not None and out["small_p95_wait_ratio"] >= 0
    assert out["largest_wait_ratio"] is not None and out["largest_wait_ratio"] >= 0
    assert 1 / 3 <= out["fairness"] <= 1.0  # Jain's index over three teams
    assert isinstance(out["preemptions"], int) and out["steps_lost"] == 0
    assert out["strict"]["preemptions"] == 0  # VIGIL_QUEUE_POLICY=strict: no preemption
    jobs = len(trace(queue.Plan.from_env().shape))
    assert out["trace"]["jobs"] == jobs and out["fair"]["jobs"] == out["strict"]["jobs"] == jobs
    assert out["fair"]["finished"] > 0 and out["strict"]["finished"] > 0
    assert set(out["targets"]) and all(isinstance(met, bool) for met in out["targets"].values())
    png = tmp_path / "bench" / "queue.png"
    assert out["png"] == str(png.resolve()) and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    table = capsys.readouterr().out
    assert "utilization" in table and "target 0 steps lost to preemption" in table
