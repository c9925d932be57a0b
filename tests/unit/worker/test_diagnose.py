"""The worker's known-answer check of a device: a healthy device passes, one that computes wrong (a matmul
that flips one element, or that differs from itself) fails, and the check runs in its own process."""

from __future__ import annotations

import itertools

import pytest
import torch

from vigil_worker.diagnose import TOLERANCE, check_device, known_answer, verdict


def test_a_healthy_device_passes_every_check():
    checks = known_answer("cpu")
    assert set(checks) == set(TOLERANCE) and verdict(checks), checks


def test_a_device_that_corrupts_one_element_fails_the_matmul_check():
    def corrupt(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        out = a @ b
        out[7, 11] += 0.5  # one silently wrong element, far below a NaN's notice
        return out

    checks = known_answer("cpu", matmul=corrupt)
    assert checks["matmul"] > TOLERANCE["matmul"] and not verdict(checks)


def test_a_device_that_differs_from_itself_fails_the_repeat_check():
    calls = itertools.count()

    def flaky(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        out = a @ b
        if next(calls) == 1:
            out[0, 0] = out[0, 0] * (1 + 1e-3)
        return out

    checks = known_answer("cpu", matmul=flaky)
    assert checks["repeat"] > TOLERANCE["repeat"] and not verdict(checks)


def test_a_missing_or_nan_check_fails():
    assert not verdict({"matmul": 0.0, "repeat": 0.0})
    assert not verdict({"matmul": float("nan"), "repeat": 0.0, "reduce": 0.0})


@pytest.mark.timeout(120)
async def test_the_check_runs_in_its_own_process_and_reports_its_numbers():
    outcome = await check_device("cpu", 0, timeout_s=100)
    assert outcome.passed is True and outcome.error is None, outcome
    assert set(outcome.checks) == set(TOLERANCE) and outcome.duration_s > 0


async def test_a_check_that_cannot_finish_in_time_is_inconclusive():
    outcome = await check_device("cpu", 0, timeout_s=0.01)
    assert outcome.passed is None and "took over" in (outcome.error or "")
