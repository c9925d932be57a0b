"""Step-phase and collective timing: the wall clock on CPU, CUDA events on GPU (read after one sync)."""

from __future__ import annotations

import time

import pytest
import torch

from vigil_trainer.clock import Clock
from vigil_trainer.comm import CommTimer


class Backend:
    """Stands in for DeepSpeed's comm backend: collectives that take a known time."""

    def all_reduce(self, tensor, async_op=False):
        time.sleep(0.01)  # the collective's own duration, what is measured
        return Handle() if async_op else None


class Handle:
    def wait(self):
        time.sleep(0.01)


def test_comm_timer_counts_calls_and_async_waits_once():
    timer = CommTimer(Clock())
    timed = timer._wrap(Backend().all_reduce)
    t0 = time.perf_counter()
    timed(torch.zeros(1))
    timed(torch.zeros(1), async_op=True).wait()
    wall = time.perf_counter() - t0
    assert timer.calls == 2
    spans = timer.take_spans()
    assert len(spans) == 3  # two calls and one wait
    assert 0.03 <= timer.total(spans) <= wall  # the three sleeps, within the wall time around them
    assert timer.take() == 0.0  # taken


def test_cpu_clock_is_the_wall_clock():
    clock = Clock()
    t0 = time.perf_counter()
    a = clock.now()
    b = clock.now()
    wall = time.perf_counter() - t0
    assert isinstance(a, float) and 0 <= clock.between(a, b) <= wall  # within the wall time around it
    clock.sync()  # nothing to do on CPU


@pytest.mark.gpu
def test_cuda_clock_times_the_device_not_the_launch():
    """A long matmul is timed by events after one synchronize; the launch alone returns at once."""
    clock = Clock(cuda=True)
    x = torch.randn(4096, 4096, device="cuda")
    a = clock.now()
    t0 = time.perf_counter()
    for _ in range(20):
        x = x @ x / 4096
    launch_s = time.perf_counter() - t0
    b = clock.now()
    clock.sync()
    device_s = clock.between(a, b)
    assert device_s > launch_s
