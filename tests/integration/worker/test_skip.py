"""A skipped step changes nothing on any rank: two real DeepSpeed ranks on CPU (gloo) run the trainer's own
engine in ZeRO 0-3, fp32 and bf16; a held (finite) step and a NaN step are dropped by `skip_step` (the
one skip the trainer and the SDK share). Each rank's weights (its ZeRO-3 shard), its optimizer state and
the LR schedule stay as they were, DeepSpeed counts the steps as skipped, and the next step trains."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from tests.integration.byo.ranks import torchrun

pytestmark = [pytest.mark.integration, pytest.mark.slow]

SCRIPT = Path(__file__).with_name("skip_ranks.py")
CASES = ["zero0-fp32", "zero0-bf16", "zero1-fp32", "zero1-bf16", "zero2-fp32", "zero3-fp32", "zero3-bf16"]


@pytest.fixture(scope="module")
def seen(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[dict[str, Any]]]:
    """Every case's result on each of the two ranks (one run of both ranks for all cases)."""
    cwd = tmp_path_factory.mktemp("skip")
    ranks = torchrun(str(SCRIPT), str(cwd), cwd=cwd, timeout_s=600)
    for r in ranks:
        assert r.code == 0, f"rank {r.rank} exited {r.code}:\n{r.output[-4000:]}"
    return {c: [json.loads((cwd / f"{c}-rank{r}.json").read_text()) for r in (0, 1)] for c in CASES}


@pytest.mark.parametrize("case", CASES)
def test_a_held_and_a_nan_step_change_no_weight_and_do_not_move_the_lr(seen, case):
    for rank, got in enumerate(seen[case]):
        assert "error" not in got, f"rank {rank}: {got.get('error')}"
        for kind in ("held", "nan"):
            assert got[kind] == {"weights": True, "moments": True, "lr": True, "applied": False}, (rank, kind)
        assert got["skipped_steps"] == 2
        assert got["next"] == {"weights": False, "moments": False, "lr": False, "applied": True}, rank
        assert got["next_iteration"] == 1 and got["finite"]
