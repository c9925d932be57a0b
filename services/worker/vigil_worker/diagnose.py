"""The worker's known-answer check of one device: what decides whether a device computes wrong, where a
job's own report (a user program's `StepReplayed`) only asks for it (`DiagnoseDevice`).

Three checks, each a relative error against an answer known without the device:

- `matmul`: a fixed-seed float32 matmul on the device against the same product in float64 on the CPU
  (TF32 off: full float32 precision is asked for);
- `repeat`: the same matmul run again on the device: a device that flips bits differs from itself;
- `reduce`: the sum of 1..n in float32 on the device (every partial sum is an integer below 2**24, so
  exact whatever the reduction order) against n(n+1)/2.

The device passes when each is within `TOLERANCE`. Measured on an H200: a healthy device's matmul is
off by 3.8e-7; one element off by 0.5 makes it 4.8e-3 (fails); TF32 alone makes it 3.2e-4, which is why
the check turns TF32 off. The process takes about 6 s, most of it importing torch and starting CUDA.
Megatron's rerun and DLRover's node check work the same way: a known answer, computed on the suspect
device, in a process of the operator's, not the job's.

Run by the agent as its own process (`python -m vigil_worker.diagnose --kind gpu`, with
CUDA_VISIBLE_DEVICES naming the one device), so torch and the device's context stay out of the agent; it
prints one JSON line: {"passed": bool, "checks": {...}}.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

SEED = 31
SIZE = 512
REDUCE_N = 4096  # n(n+1)/2 = 8,390,656 < 2**24: exact in float32
TOLERANCE = {"matmul": 1e-4, "repeat": 1e-6, "reduce": 0.0}


def known_answer(device: str, matmul: Callable[[Any, Any], Any] | None = None) -> dict[str, float]:
    """Each check's relative error on `device` ("cuda", "cpu"); `matmul` stands in for the device's own
    (a test's faulty one)."""
    import torch

    if device.startswith("cuda"):
        torch.backends.cuda.matmul.allow_tf32 = False
    mm = matmul or torch.matmul
    g = torch.Generator().manual_seed(SEED)
    a = torch.randn(SIZE, SIZE, generator=g, dtype=torch.float64)  # (S, S)
    b = torch.randn(SIZE, SIZE, generator=g, dtype=torch.float64)
    reference = a @ b  # float64, on the CPU
    scale = reference.abs().max().item()
    a32, b32 = a.to(device, torch.float32), b.to(device, torch.float32)
    first = mm(a32, b32)
    again = mm(a32, b32)
    ones = torch.arange(1, REDUCE_N + 1, dtype=torch.float32, device=device)
    total = ones.sum().item()  # CPU-GPU sync point
    expected = REDUCE_N * (REDUCE_N + 1) / 2
    return {
        "matmul": (first.double().cpu() - reference).abs().max().item() / scale,
        "repeat": (first - again).abs().max().item() / scale,
        "reduce": abs(total - expected) / expected,
    }


def verdict(checks: dict[str, float]) -> bool:
    """Whether every check is within its tolerance (a NaN is not)."""
    return all(checks.get(name, float("nan")) <= limit for name, limit in TOLERANCE.items())


@dataclass(frozen=True)
class Outcome:
    """What one check of a device found: `passed` None when it could not run (`error`)."""

    passed: bool | None
    checks: dict[str, float] = field(default_factory=dict)
    error: str | None = None
    duration_s: float = 0.0


async def check_device(kind: str, index: int, timeout_s: float) -> Outcome:
    """Run the check in its own process on device `index` of this node; never raises."""
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": str(index) if kind == "gpu" else ""}
    argv = [sys.executable, "-m", "vigil_worker.diagnose", "--kind", kind]
    t0 = time.monotonic()
    try:
        proc = await asyncio.create_subprocess_exec(
            *argv, env=env, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE
        )
    except OSError as exc:
        return Outcome(None, error=f"could not start the check: {exc}")
    try:
        out, err = await asyncio.wait_for(proc.communicate(), timeout_s)
    except TimeoutError:
        with contextlib.suppress(ProcessLookupError):
            proc.kill()
        await proc.wait()
        return Outcome(None, error=f"the check took over {timeout_s:.0f}s", duration_s=time.monotonic() - t0)
    took = time.monotonic() - t0
    try:
        found = json.loads(out.decode().strip().splitlines()[-1])
        checks = {str(k): float(v) for k, v in found["checks"].items()}
        return Outcome(bool(found["passed"]), checks, duration_s=took)
    except (IndexError, KeyError, TypeError, ValueError, AttributeError):
        tail = err.decode(errors="replace").strip()[-500:]
        return Outcome(None, error=f"the check exited {proc.returncode}: {tail}", duration_s=took)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m vigil_worker.diagnose", description=__doc__)
    parser.add_argument("--kind", choices=("gpu", "cpu"), required=True, help="the device kind")
    args = parser.parse_args(argv)
    checks = known_answer("cuda" if args.kind == "gpu" else "cpu")
    print(json.dumps({"passed": verdict(checks), "checks": checks}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
