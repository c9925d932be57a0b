"""A rank's memory use, as reported with each step: the device's on GPU, the process's on CPU."""

from __future__ import annotations

import resource

import torch


def memory_bytes(device: torch.device) -> dict[str, int | None]:
    """`mem_allocated_bytes` (now) and `mem_peak_bytes` (since the start), as StepCompleted names them."""
    if device.type == "cuda":
        return {
            "mem_allocated_bytes": torch.cuda.memory_allocated(),
            "mem_peak_bytes": torch.cuda.max_memory_allocated(),
        }
    with open("/proc/self/statm") as fh:  # the rank process's resident set, for CPU slots
        rss = int(fh.read().split()[1]) * resource.getpagesize()
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # kilobytes on Linux
    return {"mem_allocated_bytes": rss, "mem_peak_bytes": peak}
