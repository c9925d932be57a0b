"""`vigil bench scaling`: tokens/s and step time at 1, 2, ... ranks, weak and strong scaling, a roofline.

The trainer's own rank program (`vigil_bench.timed_rank`, no bus) runs a preset at each world size: on
CPU 1 and 2 ranks (one thread each, tiny preset, fp32), on a GPU machine 1, 2, 4, ... up to every device
(small preset, precision auto: bf16 where the GPU has it). Two series:

- weak: the micro-batch per rank fixed (the global batch grows with the ranks);
  efficiency(W) = tokens/s(W) / (W x tokens/s(1));
- strong: the global batch fixed (micro-batch = global / W); efficiency(W) = step(1) / (W x step(W))
  in work per step, i.e. tokens/s(W) / (W x tokens/s(1)) with the same global batch.

On a GPU the micro-batch is sized to the memory (`gpu_micro_batch`: 32 on an 80 GiB or 141 GiB card)
or given with VIGIL_BENCH_SCALING_MICRO_BATCH.

Per run, a roofline point: achieved model FLOP/s per device (tokens/s x FLOPs per token / W) against
the device's peak and memory bandwidth (the table in `vigil_trainer.mfu` on GPU; measured here on
CPU: a matmul rate and a copy bandwidth), at the step's arithmetic intensity estimated as model FLOPs
per step over the bytes of training state it reads and writes (weights, gradients, Adam moments;
activations not counted, so the intensity is an upper bound). A table is printed and a PNG written
(tokens/s against ranks with the ideal line; the roofline). The JSON's `value` is tokens/s at the
largest world size (weak), `floor` W x tokens/s at one rank (linear scaling), so `ratio` is the weak
scaling efficiency. Target: >= 0.9 on GPUs joined by NVLink; on a shared CPU the figure is what the
cores give.
"""

from __future__ import annotations

import json
import os
import statistics
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from vigil.spec import parse_spec
from vigil_bench import result
from vigil_common.settings import Settings
from vigil_trainer.mfu import flops_per_token, measure_peak, peak_flops
from vigil_worker.local import start_ranks

TIMED_RANK = "vigil_bench.timed_rank"
STEPS = 12
WARMUP = 3
CPU_MICRO_BATCH = 8
# Activations per token of the `small` preset in bf16, an estimate: about 34·d bytes per layer (Korthikanti
# et al. 2022, flash attention), 12 x 26 KB, plus the logits and their gradient (50,304 x 10 bytes):
# about 0.8 MB, taken as 1.2 MB for margin.
GPU_ACTIVATION_BYTES_PER_TOKEN = 1.2e6


def gpu_micro_batch(memory_bytes: int, seq_len: int) -> int:
    """The largest power-of-two micro-batch (8 to 64) whose activations take at most half the GPU's
    memory, so that MFU is not a micro-batch-8 figure; VIGIL_BENCH_SCALING_MICRO_BATCH overrides it."""
    if (given := os.environ.get("VIGIL_BENCH_SCALING_MICRO_BATCH")) is not None:
        return int(given)
    mb = 8
    while mb < 64 and 2 * mb * seq_len * GPU_ACTIVATION_BYTES_PER_TOKEN <= 0.5 * memory_bytes:
        mb *= 2
    return mb


# Peak memory bandwidth, bytes/s, by device name (data sheets), for the roofline's sloped roof.
BANDWIDTH: tuple[tuple[str, float], ...] = (
    ("H200", 4.8e12),
    ("H100 PCIe", 2.0e12),
    ("H100 NVL", 3.9e12),
    ("H100", 3.35e12),
    ("A100", 2.0e12),
    ("L40S", 0.864e12),
    ("MI300X", 5.3e12),
)
STATE_TRAFFIC_BYTES = 32  # per parameter per step: ~16 bytes of state, read and written once


@dataclass(frozen=True)
class Run:
    series: str  # "weak" or "strong"
    world: int
    micro_batch: int
    step_s: float  # median over the measured steps, rank 0
    tokens_per_s: float  # all ranks
    flops_per_device: float  # achieved model FLOP/s per device
    intensity: float  # model FLOPs per byte of training state moved (upper bound)


def world_sizes(devices: int) -> list[int]:
    """1, 2, 4, ... up to `devices`, and `devices` itself."""
    sizes, w = [], 1
    while w < devices:
        sizes.append(w)
        w *= 2
    return [*sizes, devices]


def efficiency(base: Run, run: Run) -> float:
    """Tokens/s at W over W x tokens/s at one rank."""
    return run.tokens_per_s / (run.world * base.tokens_per_s)


def _spec(preset: str, world: int, micro_batch: int) -> dict[str, Any]:
    return {
        "name": f"scaling-{world}",
        "resources": {"gpus_per_node": world},
        "model": {"preset": preset},
        "train": {"steps": STEPS, "micro_batch": micro_batch, "warmup_steps": 2, "zero_stage": "auto"},
        "checkpoint": {"every": 1_000_000, "keep": 1},  # only step 0's, before the measured steps
    }


def _one_run(tmp: Path, series: str, preset: str, world: int, micro_batch: int) -> list[float]:
    name = f"{series}-{world}"
    run_dir = tmp / name
    run_dir.mkdir(parents=True)
    (run_dir / "spec.yaml").write_text(yaml.safe_dump(_spec(preset, world, micro_batch)))
    timings = run_dir / "timings.jsonl"
    ranks = start_ranks(
        ["--timings", str(timings), "--spec", str(run_dir / "spec.yaml"), "--job-id", name,
         "--checkpoint-root", str(tmp / "ckpt"), "--cache-dir", str(tmp / "cache")],
        world, run_dir, module=TIMED_RANK,
    )  # fmt: skip
    try:
        codes = ranks.wait(600)
    finally:
        ranks.kill()
    if any(codes):
        raise RuntimeError(f"scaling run {name} failed: exit codes {codes}\n{ranks.tail()}")
    records = [json.loads(line) for line in timings.read_text().splitlines()]
    steps = sorted((r["step"], r["seconds"]) for r in records if r["event"] == "step" and r["rank"] == 0)
    return [float(s) for _, s in steps][WARMUP:]


def _hardware() -> tuple[int, str, str, float, float]:
    """(devices, device name, precision, peak FLOP/s, bandwidth bytes/s) of this machine, per device."""
    import torch

    if torch.cuda.is_available():
        name = torch.cuda.get_device_name(0)
        precision = "bf16" if torch.cuda.is_bf16_supported() else "fp16"
        peak = peak_flops(name, precision, override_tflops=Settings.load().peak_tflops)
        bandwidth = next((bw for pattern, bw in BANDWIDTH if pattern in name), 0.0)
        return torch.cuda.device_count(), name, precision, peak.flops if peak else 0.0, bandwidth
    torch.set_num_threads(1)  # as each rank runs
    cpu = torch.device("cpu")
    peak = measure_peak(cpu)
    a = torch.empty(16 * 2**20, dtype=torch.float32)  # 64 MiB
    b = torch.empty_like(a)
    best = float("inf")
    for _ in range(5):
        t0 = time.perf_counter()
        b.copy_(a)
        best = min(best, time.perf_counter() - t0)
    return 2, "cpu (1 thread per rank)", "fp32", peak, 2 * a.numel() * 4 / best


def run(settings: Settings) -> dict[str, Any]:
    devices, device_name, precision, peak, bandwidth = _hardware()
    gpu = device_name != "cpu (1 thread per rank)"
    preset = "small" if gpu else "tiny"
    import torch

    micro = CPU_MICRO_BATCH
    if gpu:
        seq_len = parse_spec(_spec(preset, 1, 8)).model.resolved().seq_len
        micro = gpu_micro_batch(torch.cuda.get_device_properties(0).total_memory, seq_len)
    dims = parse_spec(_spec(preset, 1, micro)).model.resolved()
    fpt = flops_per_token(dims)

    from vigil_trainer.model import GPT

    with torch.device("meta"):
        n_params = GPT(dims).num_params()
    sizes = world_sizes(devices)
    runs: list[Run] = []
    with tempfile.TemporaryDirectory(prefix="vigil-bench-scaling-") as tmpdir:
        tmp = Path(tmpdir)
        for world in sizes:
            series_batches = [("weak", micro)] + ([("strong", micro // world)] if world > 1 else [])
            for series, b in series_batches:
                if b < 1:
                    continue
                step_s = statistics.median(_one_run(tmp, series, preset, world, b))
                tokens_per_s = world * b * dims.seq_len / step_s
                runs.append(
                    Run(
                        series=series,
                        world=world,
                        micro_batch=b,
                        step_s=step_s,
                        tokens_per_s=tokens_per_s,
                        flops_per_device=tokens_per_s * fpt / world,
                        intensity=b * dims.seq_len * fpt / (n_params * STATE_TRAFFIC_BYTES),
                    )
                )
    base = runs[0]
    rows = []
    for r in runs:
        rows.append(
            {
                "series": r.series,
                "ranks": r.world,
                "micro_batch": r.micro_batch,
                "step_s": round(r.step_s, 4),
                "tokens_per_s": round(r.tokens_per_s, 1),
                "efficiency": round(efficiency(base, r), 4),
                "mfu": round(r.flops_per_device / peak, 4) if peak else None,
                "tflops_per_device": round(r.flops_per_device / 1e12, 4),
                "intensity_flops_per_byte": round(r.intensity, 2),
            }
        )
    _print_table(rows)
    png = (settings.data_dir / "bench" / "scaling.png").resolve()
    _plot(png, runs, base, peak, bandwidth, f"{preset} on {device_name}, {precision}")
    top = max((r for r in runs if r.series == "weak"), key=lambda r: r.world)
    strong = [r for r in runs if r.series == "strong"]
    return result(
        "scaling",
        top.tokens_per_s,
        top.world * base.tokens_per_s,
        "tokens/s",
        "weak-scaling efficiency (ratio) >= 0.9 on NVLink GPUs; CPU: what the shared cores give",
        device=device_name,
        precision=precision,
        preset=preset,
        flops_per_token=fpt,
        peak_tflops_per_device=round(peak / 1e12, 4),
        peak_source="table or VIGIL_PEAK_TFLOPS" if gpu else "measured matmul, 1 thread",
        bandwidth_gb_s=round(bandwidth / 1e9, 2),
        weak_efficiency=round(efficiency(base, top), 4),
        strong_efficiency=round(efficiency(base, strong[-1]), 4) if strong else None,
        runs=rows,
        png=str(png),
    )


def _print_table(rows: list[dict[str, Any]]) -> None:
    cols = ["series", "ranks", "micro_batch", "step_s", "tokens_per_s", "efficiency", "mfu"]
    cols.append("tflops_per_device")
    print("  ".join(f"{c:>14}" for c in cols))
    for row in rows:
        print("  ".join(f"{row[c]!s:>14}" for c in cols))


def _plot(path: Path, runs: list[Run], base: Run, peak: float, bandwidth: float, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    path.parent.mkdir(parents=True, exist_ok=True)
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 5), dpi=110)
    for series, marker in (("weak", "o"), ("strong", "s")):
        pts = [(r.world, r.tokens_per_s) for r in runs if r.series == series or (r.world == 1)]
        if len(pts) > 1:
            left.plot(*zip(*sorted(pts), strict=True), marker=marker, label=f"{series} scaling")
    worlds = sorted({r.world for r in runs})
    left.plot(worlds, [w * base.tokens_per_s for w in worlds], "k--", label="linear")
    left.set(xlabel="ranks", ylabel="tokens/s", title=f"throughput: {title}", xticks=worlds)
    left.legend()
    xs = [r.intensity for r in runs]
    ridge = peak / bandwidth if peak and bandwidth else min(xs)
    lo, hi = min(min(xs), ridge) / 10, max(max(xs), ridge) * 10  # the ridge point in view
    if peak and bandwidth:
        grid = [lo, ridge, hi]
        right.loglog(grid, [min(peak, bandwidth * x) for x in grid], "k-", label="roofline")
    for r in runs:
        right.loglog(r.intensity, r.flops_per_device, "o", label=f"{r.series} x{r.world}")
    right.set(xlabel="FLOPs per byte of training state", ylabel="model FLOP/s per device", title="roofline")
    right.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
