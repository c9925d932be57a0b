"""Each example under examples/byo/ as two ranks started the way torchrun starts them, with no Vigil: the
SDK is inert, the program trains to its last step, and the step guard still keeps a NaN that rank 1
makes at a known step out of every rank's weights."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.integration.byo.ranks import torchrun

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.byo]

STEPS = ["--steps", "8", "--save-every", "4", "--nan-at", "3"]


def trains_to_the_end(tmp_path: Path, script: str, *args: str) -> None:
    ranks = torchrun(script, *STEPS, "--out", str(tmp_path / "out"), *args, cwd=tmp_path)
    for r in ranks:
        assert r.code == 0, f"rank {r.rank} exited {r.code}:\n{r.output[-4000:]}"
        assert "not running under Vigil" in r.output
        assert r.result["steps"] == 8
        assert r.result["finite_weights"], f"rank {r.rank}: the NaN step reached the weights"
    assert (tmp_path / "out" / "nan-at-3.done").exists(), "the fault was not injected"


def test_hf_trainer_with_the_callback_trains_alone(tmp_path):
    trains_to_the_end(tmp_path, "hf_trainer.py")
    assert sorted(p.name for p in (tmp_path / "out").glob("checkpoint-*")) == ["checkpoint-4", "checkpoint-8"]


def test_hf_trainer_through_deepspeed_zero1_trains_alone(tmp_path):
    trains_to_the_end(tmp_path, "hf_trainer.py", "--zero", "1")


def test_lightning_ddp_with_the_callback_trains_alone(tmp_path):
    trains_to_the_end(tmp_path, "lightning_ddp.py")


@pytest.mark.parametrize("zero", ["0", "1"])
def test_a_deepspeed_loop_with_the_helpers_trains_alone(tmp_path, zero):
    trains_to_the_end(tmp_path, "deepspeed_loop.py", "--zero", zero)


def test_a_plain_ddp_loop_on_the_core_api_trains_alone(tmp_path):
    trains_to_the_end(tmp_path, "ddp_loop.py")
