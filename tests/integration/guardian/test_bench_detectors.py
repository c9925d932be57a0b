"""`vigil bench detectors`, small: one job per row of its table through the real bus and the real
guardian process, scored from the incidents read back."""

from __future__ import annotations

import pytest

from vigil_bench.detectors import FULL_RECALL, evaluate
from vigil_common.settings import Settings

pytestmark = pytest.mark.integration


async def test_the_detector_bench_runs_small_and_its_targets_hold(nats_url, migrated, tmp_path, capsys):
    settings = Settings.load(nats_url=nats_url, database_url=migrated, data_dir=tmp_path, metrics_port=0)
    out = await evaluate(settings, steps=300, clean_jobs={0.03: 2}, small=True, seed=5)
    table = out["faults"]
    for row in FULL_RECALL:
        assert table[row]["recall"] == 1.0, (row, table[row])
    assert table["nan"]["right_rank"] == 1.0 and table["spike"]["right_rank"] == 1.0
    assert table["hang"]["delay_s"]["max"] < 30
    assert all(r["delay_steps"] is not None for k, r in table.items() if k.startswith("divergence"))
    assert out["false_alarms"]["3%"] == {"clean_rank_steps": 2400, "false_alarms": 0, "per_10k": 0.0}
    assert {"bench", "value", "floor", "ratio", "unit", "target", "ok"} <= set(out)
    assert "| fault | jobs | recall |" in capsys.readouterr().out  # the table, as the README shows it
