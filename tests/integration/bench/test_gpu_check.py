"""`scripts/gpu-check.sh` on a machine without a GPU runs its CPU half: one JSON line per check, the GPU
ones skipped with their reason, the held sdc and spike replayed clean on the CPU, the in-memory snapshot
and rollback paths at ZeRO 1 (every loss the fault-free run's), a warm rank's first step, and the mfu
bench's JSON contract at one pair of short runs. No speed asserted (that is the bench's, on an idle
machine)."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
import torch

pytestmark = [pytest.mark.integration, pytest.mark.slow]

SCRIPT = Path(__file__).resolve().parents[3] / "scripts" / "gpu-check.sh"


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is here: the script runs its GPU checks")
def test_the_cpu_half_runs_and_says_what_it_skipped() -> None:
    out = subprocess.run(["bash", str(SCRIPT)], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, (out.stdout + out.stderr)[-4000:]
    lines = [json.loads(line) for line in out.stdout.strip().splitlines()]
    by = {line["check"]: line for line in lines}
    assert list(by) == [
        "pytest_gpu",
        "nvml",
        "held_on_device",
        "snapshot_rollback_on_device",
        "warm_rank_on_device",
        "mfu",
        "overhead_one_rank",
        "hf_trainer_on_device",
        "nccl_kill_and_replace",
    ]
    for check in ("pytest_gpu", "nvml", "overhead_one_rank", "hf_trainer_on_device", "nccl_kill_and_replace"):
        assert by[check]["status"] == "skip" and by[check]["reason"], by[check]
    assert by["held_on_device"]["status"] == "pass" and by["held_on_device"]["held"] == [
        ["4", "nan"],
        ["7", "spike"],
    ]
    snap = by["snapshot_rollback_on_device"]
    assert snap["status"] == "pass" and snap["device"] == "cpu" and list(snap["stages"]) == ["1"], snap
    zero1 = snap["stages"]["1"]
    assert zero1["rollback"]["from_memory"] and zero1["rollback"]["to_step"] == 8
    assert zero1["relaunch_resumed_at"] == 10 and zero1["spoilt_params"] > 0
    assert zero1["max_rel_diff"] <= zero1["tolerance"]
    warm = by["warm_rank_on_device"]
    assert warm["status"] == "pass" and warm["device"] == "cpu", warm
    assert warm["first_step_s"] > 0 and warm["cold_first_step_s"] > 0
    mfu = by["mfu"]
    assert mfu["status"] == "pass" and mfu["pairs"] == 1 and not mfu["compiled"]
    assert set(mfu["tokens_per_s"]) == {"8", "32"} and all(
        t > 0 for pair in mfu["tokens_per_s"].values() for t in pair
    )
    assert 0 < mfu["ratio"] < 10
