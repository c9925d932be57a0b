"""One rank alone, in every ZeRO stage: it trains (at world 1 DeepSpeed's backward all-reduce is turned
off without ZeRO only; ZeRO 1 and 2 take their gradients from it, and failed with a KeyError)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.integration, pytest.mark.slow]


@pytest.mark.parametrize("zero", [0, 1, 2, 3])
def test_one_rank_trains_in_every_zero_stage(tmp_path: Path, zero: int) -> None:
    spec = {
        "name": f"one-rank-{zero}",
        "resources": {"nodes": 1, "gpus_per_node": 1},
        "model": {"preset": "tiny", "n_layer": 2, "seq_len": 32},
        "train": {"steps": 3, "micro_batch": 4, "lr": 3e-3, "warmup_steps": 1, "zero_stage": zero, "seed": 0},
        "checkpoint": {"every": 100, "keep": 2},
    }
    (tmp_path / "spec.json").write_text(json.dumps(spec))
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1",
           "RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "0"}  # fmt: skip
    env = {k: v for k, v in env.items() if not k.startswith("VIGIL_")}
    done = subprocess.run(
        [sys.executable, "-m", "vigil_trainer", "--spec", str(tmp_path / "spec.json"),
         "--checkpoint-root", str(tmp_path / "ckpt"), "--cache-dir", str(tmp_path / "cache")],
        env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "done: 3 steps" in done.stdout + done.stderr
