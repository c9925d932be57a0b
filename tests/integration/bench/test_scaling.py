"""`vigil bench scaling` with real ranks (1 and 2 on CPU), fewer steps: a table, a PNG and the JSON."""

from __future__ import annotations

import pytest

from vigil_bench import scaling
from vigil_common.settings import Settings

pytestmark = [pytest.mark.integration, pytest.mark.slow]


def test_world_sizes():
    assert scaling.world_sizes(1) == [1]
    assert scaling.world_sizes(2) == [1, 2]
    assert scaling.world_sizes(8) == [1, 2, 4, 8]
    assert scaling.world_sizes(6) == [1, 2, 4, 6]


def test_scaling_bench_prints_json_and_writes_a_png(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(scaling, "STEPS", 5)
    monkeypatch.setattr(scaling, "WARMUP", 2)
    out = scaling.run(Settings.load(data_dir=tmp_path))
    assert out["bench"] == "scaling" and out["unit"] == "tokens/s"
    assert out["ratio"] == pytest.approx(out["value"] / out["floor"], rel=1e-3)
    assert [(r["series"], r["ranks"], r["micro_batch"]) for r in out["runs"]] == [
        ("weak", 1, 8),
        ("weak", 2, 8),
        ("strong", 2, 4),
    ]
    for row in out["runs"]:
        assert row["tokens_per_s"] > 0 and row["step_s"] > 0 and row["mfu"] > 0
    assert out["weak_efficiency"] == out["ratio"] and out["strong_efficiency"] > 0
    png = tmp_path / "bench" / "scaling.png"
    assert str(png.resolve()) == out["png"] and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "efficiency" in capsys.readouterr().out  # the table
