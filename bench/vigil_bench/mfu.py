"""`vigil bench mfu`: the built-in trainer beside the ceiling, the same model in a plain PyTorch loop.

Two programs run on the same device, one rank each, alternating (the order flips every pair, so drift on
a shared machine hits both alike), at two micro-batches:

- the trainer: the built-in trainer's rank (`vigil_bench.timed_rank`), with everything Vigil adds to a
  step on (the finiteness guard and command boundary, the step judge, section timers, the comm timer,
  and a StepCompleted per step through an agent's relay to a real NATS);
- the ceiling: Vigil's `GPT` stepped by a plain PyTorch loop (`vigil_bench.ceiling`): bf16 autocast on
  a GPU, fused AdamW, clipping, and `torch.compile` wherever the trainer compiles (`train.compile: auto`:
  on a GPU; on a CPU neither compiles).

On a GPU: the `small` preset (124M parameters, seq 1024), micro-batches 8 and 32. On a CPU: `tiny`
(3.2M, seq 128), micro-batches 8 and 32, one thread per rank. tokens/s is micro-batch x seq_len over
the median step time after WARMUP steps (the first steps hold the compile, reported as `first_step_s`);
MFU is tokens/s x model FLOPs per token over the device's peak (the data sheet on a GPU, a measured
matmul rate on a CPU). The JSON's `value` and `floor` are the trainer's and the ceiling's tokens/s at the
micro-batch where the trainer falls furthest behind, so `ratio` is the worse of the two. Target: ratio
>= 0.90 on a GPU, and on a CPU against the eager loop.
"""

from __future__ import annotations

import contextlib
import json
import os
import statistics
from pathlib import Path
from typing import Any

import torch
import yaml

from vigil.spec import parse_spec
from vigil_bench import result, servers
from vigil_common.settings import Settings
from vigil_trainer.mfu import flops_per_token, measure_peak, peak_flops
from vigil_worker.local import LocalAgent, start_ranks

TIMED_RANK = "vigil_bench.timed_rank"
WARMUP = 5
PRESET = {"cpu": "tiny", "cuda": "small"}
MICRO_BATCHES = {"cpu": (8, 32), "cuda": (8, 32)}


def pairs() -> int:
    """Pairs of runs (VIGIL_BENCH_MFU_PAIRS, default 3; scripts/gpu-check.sh's CPU half runs 1)."""
    return int(os.environ.get("VIGIL_BENCH_MFU_PAIRS", "3"))


def steps() -> int:
    """Steps per run, the first WARMUP not measured (VIGIL_BENCH_MFU_STEPS, default 30)."""
    return max(WARMUP + 3, int(os.environ.get("VIGIL_BENCH_MFU_STEPS", "30")))


def spec_for(kind: str, micro_batch: int) -> dict[str, Any]:
    return {
        "name": f"bench-mfu-{micro_batch}",
        "resources": {"gpus_per_node": 1},
        "model": {"preset": PRESET[kind]},
        "train": {"steps": steps(), "micro_batch": micro_batch, "warmup_steps": 2},
        "checkpoint": {"every": 1_000_000, "keep": 1},  # no periodic checkpoint inside the measured steps
    }


def _one_run(tmp: Path, name: str, spec: Path, extra: list[str], agent: LocalAgent | None) -> list[float]:
    run_dir = tmp / name
    timings = run_dir / "timings.jsonl"
    ranks = start_ranks(
        ["--timings", str(timings), *extra, "--spec", str(spec), "--job-id", name,
         "--checkpoint-root", str(tmp / "ckpt"), "--cache-dir", str(tmp / "cache")],
        1, run_dir, module=TIMED_RANK, agent=agent, job=(name, 1),
    )  # fmt: skip
    try:
        codes = ranks.wait(900)
    finally:
        ranks.kill()
    if codes != [0]:
        raise RuntimeError(f"bench run {name} failed: exit code {codes}\n{ranks.tail()}")
    steps = sorted(
        (r["step"], r["seconds"])
        for r in map(json.loads, timings.read_text().splitlines())
        if r["event"] == "step" and r["rank"] == 0
    )
    return [float(s) for _, s in steps]


def device_peak(kind: str) -> tuple[float, str]:
    """The peak FLOP/s MFU is taken against, and where it comes from."""
    if kind == "cuda":
        name = torch.cuda.get_device_name(0)
        peak = peak_flops(name, "bf16" if torch.cuda.is_bf16_supported() else "fp16", override_tflops=None)
        if peak is None:
            dtype = torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
            return measure_peak(torch.device("cuda", 0), dtype, n=8192), f"{name}: measured"
        return peak.flops, f"{name}: {peak.source}"
    torch.set_num_threads(1)  # the ranks' one thread
    return measure_peak(torch.device("cpu")), "cpu, 1 thread: measured matmul rate"


def run(settings: Settings) -> dict[str, Any]:
    kind = "cuda" if torch.cuda.is_available() else "cpu"
    peak, peak_source = device_peak(kind)
    rows: list[dict[str, Any]] = []
    with contextlib.ExitStack() as stack:
        settings, where = servers(stack, settings, database=False)
        tmp, url = settings.data_dir, settings.nats_url
        assert url
        agent = stack.enter_context(LocalAgent(url, tmp / "ckpt"))
        for mb in MICRO_BATCHES[kind]:
            spec_file = tmp / f"spec-{mb}.yaml"
            spec_file.write_text(yaml.safe_dump(spec_for(kind, mb)))
            dims = parse_spec(spec_file.read_text()).model.resolved()
            fpt, tokens = flops_per_token(dims), mb * dims.seq_len
            got: dict[str, list[list[float]]] = {"trainer": [], "ceiling": []}
            for i in range(pairs()):
                for side in ("ceiling", "trainer") if i % 2 == 0 else ("trainer", "ceiling"):
                    extra = ["--ceiling"] if side == "ceiling" else []
                    name = f"{side}-{mb}-{i}"
                    got[side].append(
                        _one_run(tmp, name, spec_file, extra, agent if side == "trainer" else None)
                    )
            row: dict[str, Any] = {"micro_batch": mb}
            for side, runs in got.items():
                step_s = statistics.median(s for r in runs for s in r[WARMUP:])
                tps = tokens / step_s
                row[side] = {
                    "step_s": round(step_s, 6),
                    "tokens_per_s": round(tps, 1),
                    "mfu": round(tps * fpt / peak, 4),
                    "first_step_s": round(statistics.median(r[0] for r in runs), 3),
                }
            row["ratio"] = round(row["trainer"]["tokens_per_s"] / row["ceiling"]["tokens_per_s"], 4)
            rows.append(row)
            print(
                f"micro-batch {mb}: trainer {row['trainer']['tokens_per_s']:.0f} tok/s"
                f" (MFU {row['trainer']['mfu']:.1%}), plain PyTorch"
                f" {row['ceiling']['tokens_per_s']:.0f} tok/s (MFU {row['ceiling']['mfu']:.1%}):"
                f" ratio {row['ratio']:.3f}",
                flush=True,
            )
    worst = min(rows, key=lambda r: r["ratio"])
    return result(
        "mfu",
        worst["trainer"]["tokens_per_s"],
        worst["ceiling"]["tokens_per_s"],
        "tokens/s",
        "ratio >= 0.90 (trainer / plain PyTorch, the worse micro-batch)",
        device=peak_source,
        preset=PRESET[kind],
        compiled=kind == "cuda",
        runs=rows,
        steps_measured_per_run=steps() - WARMUP,
        pairs=pairs(),
        servers=where,
    )
