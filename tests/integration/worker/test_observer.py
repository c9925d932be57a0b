"""The observer seam from outside: real ranks under `vigil_bench.timed_rank`, as the benches run them."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from vigil_worker.local import start_ranks

pytestmark = [pytest.mark.integration, pytest.mark.slow]

STEPS = 4


def run(tmp_path: Path, name: str, extra: list[str]) -> list[dict]:
    spec = {
        "name": "observer",
        "resources": {"gpus_per_node": 2},
        "model": {"preset": "tiny", "n_layer": 2, "seq_len": 32},
        "train": {"steps": STEPS, "micro_batch": 4, "zero_stage": 1, "warmup_steps": 1},
        "checkpoint": {"every": 1000, "keep": 1},
    }
    (tmp_path / "spec.yaml").write_text(yaml.safe_dump(spec))
    timings = tmp_path / f"{name}.jsonl"
    ranks = start_ranks(
        ["--timings", str(timings), *extra, "--spec", str(tmp_path / "spec.yaml"), "--job-id", name,
         "--checkpoint-root", str(tmp_path / "ckpt"), "--cache-dir", str(tmp_path / "cache")],
        2, tmp_path / name, module="vigil_bench.timed_rank",
    )  # fmt: skip
    try:
        assert ranks.wait(240) == [0, 0], ranks.tail()
    finally:
        ranks.kill()
    return [json.loads(line) for line in timings.read_text().splitlines()]


@pytest.mark.parametrize("extra", [[], ["--plain"]], ids=["vigil", "plain"])
def test_each_rank_reports_every_step_once(tmp_path, extra):
    name = "plain" if extra else "vigil"
    records = run(tmp_path, name, extra)
    for rank in (0, 1):
        steps = [r for r in records if r["rank"] == rank and r["event"] == "step"]
        assert [r["step"] for r in steps] == list(range(STEPS))
        assert all(r["seconds"] > 0 for r in steps)
        # and, once at the end, what its in-memory snapshots cost (the plain loop takes none)
        snaps = [r for r in records if r["rank"] == rank and r["event"] == "snapshots"]
        assert len(snaps) == (0 if extra else 1)
        assert all(r["steps"] == STEPS and r["taken"] >= 1 and r["copy_s"] > 0 for r in snaps)
    assert {r["event"] for r in records} <= {"step", "snapshots"}
    # the Vigil rank saved its step-0 checkpoint; the plain loop has none of Vigil's machinery
    assert (tmp_path / "ckpt" / name / "step_00000000").is_dir() == (not extra)
