"""`scripts/gpu-check.sh`: what a lent GPU should be used for, in one run of under eight minutes.

`python -m vigil_bench.gpu_check [CHECK ...]` prints one JSON line per check (all of them, or those
named), as it finishes:

- `pytest_gpu`: the tests marked `gpu`;
- `nvml`: one sample of device 0 through the worker's own NVML inventory;
- `held_on_device`: a held sdc NaN and an sdc spike, each replayed clean, on the device;
- `snapshot_rollback_on_device`: the in-memory snapshot and rollback paths, bf16, ZeRO 1 and 2: a fault
  while held rolled back from memory, a crash relaunched from a snapshot, every loss the fault-free
  run's (`gpu_recovery`);
- `warm_rank_on_device`: a warm rank takes a job on the device: launch to first step, beside a cold start;
- `mfu`: `vigil bench mfu`, the trainer beside the same model in a plain PyTorch loop;
- `overhead_one_rank`: `vigil bench overhead`, one rank on the GPU (trainer vs plain DeepSpeed);
- `hf_trainer_on_device`: the HF Trainer example (examples/byo/hf_trainer.py) at one rank on the GPU
  under the SDK against `--no-vigil` (`vigil bench sdk`'s runner, 3 pairs), and a NaN it holds (`gpu_hf`);
- `nccl_kill_and_replace`: a 2-rank NCCL job's rank 1 killed and replaced, where 2+ GPUs are (skipped
  on one GPU, and not written yet for more).

Each line is `{"check": ..., "status": "pass" | "fail" | "skip", "seconds": ..., ...}`. On a machine
without a GPU the CPU half runs (`mfu` with one pair of runs and fewer steps, `held_on_device`, the
snapshot and rollback check at ZeRO 1 and the warm rank on the CPU, these three on a smaller model:
`gpu_recovery.model`) and the rest says `skip` with the reason (`hf_trainer_on_device` too: `vigil bench
sdk` is its CPU figure; `VIGIL_GPU_CHECK_HF_ON_CPU=1` runs it); CI runs that half
(tests/integration/bench). The exit code is 1 when a check failed, 2 for an unknown check's name.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import yaml

from vigil_bench.gpu_hf import hf_trainer_on_device
from vigil_bench.gpu_recovery import (
    model,
    nccl_kill_and_replace,
    snapshot_rollback_on_device,
    warm_rank_on_device,
)

REPO = Path(__file__).resolve().parents[2]
Result = dict[str, Any]


def _vigil(args: list[str], env: dict[str, str], timeout: float) -> dict[str, Any]:
    """Run `vigil ARGS` (the CLI's main, so that it also runs where vigil is not installed); its last line."""
    cmd = [sys.executable, "-c", "from vigil_cli.main import main; main()", *args]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    if out.returncode != 0:
        raise RuntimeError(
            f"vigil {' '.join(args)}: exit {out.returncode}\n{(out.stdout + out.stderr)[-3000:]}"
        )
    if "publishing" in out.stderr:  # the relay could not store a rank's event: the run was not Vigil's
        raise RuntimeError(f"vigil {' '.join(args)}: events not stored\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def pytest_gpu(cuda: bool) -> Result:
    if not cuda:
        return {"status": "skip", "reason": "no CUDA device: the gpu tests skip here"}
    # the files that hold gpu tests (a device machine lacks some test-only packages other files import)
    files = sorted(
        str(p.relative_to(REPO)) for p in (REPO / "tests").rglob("test_*.py") if "mark.gpu" in p.read_text()
    )
    cmd = [sys.executable, "-m", "pytest", "-m", "gpu", "-q", "-p", "no:cacheprovider", *files]
    out = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=240)
    tail = out.stdout.strip().splitlines()[-1] if out.stdout.strip() else out.stderr[-500:]
    return {"status": "pass" if out.returncode == 0 else "fail", "summary": tail}


def mfu(cuda: bool) -> Result:
    # one pair of runs (under five minutes in all on an H200 with inductor's cache cold: 3 pairs took
    # 432 s there); the full bench, three pairs, is `vigil bench mfu`. The CPU half: fewer steps too.
    env = {"VIGIL_BENCH_MFU_PAIRS": "1", **os.environ}
    if not cuda:
        env.update(VIGIL_BENCH_MFU_PAIRS="1", VIGIL_BENCH_MFU_STEPS="8")  # 5 warm-up + 3 measured
    got = _vigil(["bench", "mfu"], env, timeout=600)
    runs = {r["micro_batch"]: r for r in got["runs"]}

    def both(key: str) -> dict[int, list[float]]:  # micro-batch -> [trainer, plain PyTorch]
        return {mb: [r["trainer"][key], r["ceiling"][key]] for mb, r in runs.items()}

    return {
        "status": "pass",
        "ratio": got["ratio"],
        "target": got["target"],
        "device": got["device"],
        "compiled": got["compiled"],
        "tokens_per_s": {
            mb: [r["trainer"]["tokens_per_s"], r["ceiling"]["tokens_per_s"]] for mb, r in runs.items()
        },
        "mfu": {mb: [r["trainer"]["mfu"], r["ceiling"]["mfu"]] for mb, r in runs.items()},
        "first_step_s": {
            mb: [r["trainer"]["first_step_s"], r["ceiling"]["first_step_s"]] for mb, r in runs.items()
        },
        "pairs": got["pairs"],
    }


def overhead_one_rank(cuda: bool) -> Result:
    if not cuda:
        return {
            "status": "skip",
            "reason": "no CUDA device: `vigil bench overhead` runs its 2-rank CPU form here",
        }
    got = _vigil(["bench", "overhead"], {"VIGIL_BENCH_OVERHEAD_PAIRS": "1", **os.environ}, timeout=400)
    keys = ("value", "floor", "ratio", "target", "config", "steps_measured")
    return {"status": "pass", **{k: got[k] for k in keys}}


def held_on_device(cuda: bool) -> Result:
    """One rank of the built-in trainer with an sdc NaN at step 4 and an sdc spike (x50) at step 7: each
    is held at the boundary and replayed clean (its log says so), and the run ends well."""
    with tempfile.TemporaryDirectory(prefix="vigil-gpu-check-") as tmp:
        spec = {
            "name": "gpu-check-held",
            "model": model(cuda),
            "train": {"steps": 10, "micro_batch": 8, "warmup_steps": 1},
            "checkpoint": {"every": 1000},
            "guardian": {"spike_warmup": 3},
            "faults": [
                {"kind": "sdc", "step": 4, "rank": 0},
                {"kind": "sdc", "step": 7, "rank": 0, "factor": 50},
            ],
        }
        (Path(tmp) / "spec.yaml").write_text(yaml.safe_dump(spec))
        env = {
            **{k: v for k, v in os.environ.items() if not k.startswith("VIGIL_")},
            "RANK": "0",
            "WORLD_SIZE": "1",
            "LOCAL_RANK": "0",
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(29_000 + os.getpid() % 1000),
        }
        cmd = [sys.executable, "-m", "vigil_trainer", "--spec", f"{tmp}/spec.yaml",
               "--checkpoint-root", f"{tmp}/ckpt", "--cache-dir", f"{tmp}/cache"]  # fmt: skip
        out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    log = out.stdout + out.stderr
    held = re.findall(r"step (\d+): held \((\w+) on ranks", log)
    clean = re.findall(r"step (\d+): the replay is clean", log)
    ok = out.returncode == 0 and held == [("4", "nan"), ("7", "spike")] and clean == ["4", "7"]
    result: Result = {"status": "pass" if ok else "fail", "device": "cuda" if cuda else "cpu", "held": held}
    if not ok:
        result["log"] = log[-3000:]
    return result


def nvml(cuda: bool) -> Result:
    from vigil_worker.inventory import Inventory

    inv = Inventory.discover(cpu_slots=1, node="gpu-check", backend="auto")
    try:
        if inv.kind != "gpu":
            return {"status": "skip", "reason": "no NVML device (no NVIDIA driver here)"}
        sample = inv.sample("gpu-check", lambda index: None)[0]
        fields = (
            "index",
            "uuid",
            "utilization_pct",
            "memory_used_bytes",
            "memory_total_bytes",
            "temperature_c",
            "power_w",
            "sm_clock_mhz",
            "throttle_reasons",
            "ecc_uncorrected",
        )
        return {"status": "pass", **{k: getattr(sample, k) for k in fields}}
    finally:
        inv.close()


CHECKS: tuple[tuple[str, Callable[[bool], Result]], ...] = (
    ("pytest_gpu", pytest_gpu),
    ("nvml", nvml),
    ("held_on_device", held_on_device),
    ("snapshot_rollback_on_device", snapshot_rollback_on_device),
    ("warm_rank_on_device", warm_rank_on_device),
    ("mfu", mfu),
    ("overhead_one_rank", overhead_one_rank),
    ("hf_trainer_on_device", hf_trainer_on_device),
    ("nccl_kill_and_replace", nccl_kill_and_replace),
)


def main(argv: list[str] | None = None) -> int:
    names = sys.argv[1:] if argv is None else argv
    if unknown := sorted(set(names) - {name for name, _ in CHECKS}):
        print(f"unknown check(s) {unknown}; the checks: {[name for name, _ in CHECKS]}", file=sys.stderr)
        return 2
    cuda = torch.cuda.is_available()
    failed = 0
    for name, check in CHECKS:
        if names and name not in names:
            continue
        t0 = time.perf_counter()
        try:
            result = check(cuda)
        except Exception as exc:  # one check's failure is its line; the others still run
            result = {"status": "fail", "error": f"{type(exc).__name__}: {exc}"[-3000:]}
        failed += result["status"] == "fail"
        print(
            json.dumps({"check": name, **result, "seconds": round(time.perf_counter() - t0, 1)}), flush=True
        )
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
