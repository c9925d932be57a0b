"""`vigil bench overhead`: the cost of Vigil's instrumentation on a training step.

The same two-rank DeepSpeed job (tiny GPT, ZeRO-1, CPU, gloo) runs with everything Vigil adds to a step
on (section timers, the comm timer, the per-step control all-reduce with the finiteness guard and command
boundary, and a StepCompleted event per rank per step sent from the rank's background thread through an
agent's relay to a real NATS) and off (a plain DeepSpeed loop over the same engine, model and data). Both
run as `python -m vigil_bench.timed_rank`, which records each step's wall time (`--plain` for off). Runs
alternate, the order flipping every pair, so drift on a shared machine hits both alike. `value` is the
median step time with Vigil on, `floor` with it off, both over every step after the first WARMUP of each
run. The Vigil side takes in-memory snapshots as a job does (`checkpoint.memory_every` auto, files on
/dev/shm, the peer copy swapped with the other rank); `snapshot_cost_s_per_step` is what they cost rank 0
per step at the interval auto chose (`snapshot_every`): one snapshot's copy and waits that hold the
step plus the background's CPU time, measured over the run, over that interval; `snapshot_ratio` is
(step time + that cost) / step time.
Target: ratio <= 1.03 on a CPU configuration whose step takes at least 50 ms. On a GPU machine the same
comparison runs at one rank on the GPU: the `small` preset, micro-batch 8, precision and compile auto
(bf16 autocast, compiled, on both sides: the plain loop steps the very engine the trainer builds).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import statistics
import tempfile
from pathlib import Path

import torch
import yaml

from vigil_bench import result, servers
from vigil_common.settings import Settings
from vigil_worker.local import LocalAgent, start_ranks

TIMED_RANK = "vigil_bench.timed_rank"
STEPS = 20
WARMUP = 4
SPEC = {
    "name": "bench-overhead",
    "resources": {"gpus_per_node": 2},
    "model": {"preset": "tiny"},  # 3.2M parameters, seq_len 128
    "train": {"steps": STEPS, "micro_batch": 8, "zero_stage": 1, "warmup_steps": 2},
    "checkpoint": {"every": 1_000_000, "keep": 1},  # no periodic checkpoint inside the measured steps
}
CPU_CONFIG = "tiny GPT 3.2M params, seq 128, micro-batch 8, 2 ranks, ZeRO-1, fp32, CPU/gloo, 1 thread/rank"
GPU_SPEC = {
    "name": "bench-overhead",
    "resources": {"gpus_per_node": 1},
    "model": {"preset": "small"},  # 124M parameters, seq_len 1024
    "train": {"steps": STEPS, "micro_batch": 8, "warmup_steps": 2},
    "checkpoint": {"every": 1_000_000, "keep": 1},
}
GPU_CONFIG = (
    "small GPT 124M params, seq 1024, micro-batch 8, 1 rank, ZeRO auto (0), precision and compile auto"
)


def pairs() -> int:
    return int(os.environ.get("VIGIL_BENCH_OVERHEAD_PAIRS", "3"))


def _one_run(
    tmp: Path,
    name: str,
    extra: list[str],
    world: int,
    agent: LocalAgent | None = None,
    snapshots: list[dict[str, float]] | None = None,
) -> list[float]:
    run_dir = tmp / name
    timings = run_dir / "timings.jsonl"
    shm = Path(tempfile.mkdtemp(prefix="vigil-bench-", dir="/dev/shm")) if Path("/dev/shm").is_dir() else None
    ranks = start_ranks(
        ["--timings", str(timings), *extra, "--spec", str(tmp / "spec.yaml"), "--job-id", name,
         "--checkpoint-root", str(tmp / "ckpt"), "--cache-dir", str(tmp / "cache")],
        world, run_dir, module=TIMED_RANK, agent=agent, job=(name, 1), snapshot_dir=shm,
    )  # fmt: skip
    try:
        codes = ranks.wait(600)
    finally:
        ranks.kill()
        if shm is not None:
            shutil.rmtree(shm, ignore_errors=True)
    if codes != [0] * world:
        raise RuntimeError(f"bench run {name} failed: exit codes {codes}\n{ranks.tail()}")
    records = [json.loads(line) for line in timings.read_text().splitlines()]
    steps = sorted((r["step"], r["seconds"]) for r in records if r["event"] == "step" and r["rank"] == 0)
    if snapshots is not None:
        snapshots += [r for r in records if r["event"] == "snapshots" and r["rank"] == 0]
    if len(steps) != STEPS:
        raise RuntimeError(f"bench run {name}: {len(steps)} step timings, expected {STEPS}")
    return [float(seconds) for _, seconds in steps][WARMUP:]


def run(settings: Settings) -> dict[str, object]:
    with contextlib.ExitStack() as stack:
        settings, _ = servers(stack, settings, database=False)
        tmp, url = settings.data_dir, settings.nats_url
        assert url

        agent = stack.enter_context(LocalAgent(url, tmp / "ckpt"))
        cuda = torch.cuda.is_available()
        world, config = (1, GPU_CONFIG) if cuda else (2, CPU_CONFIG)
        (tmp / "spec.yaml").write_text(yaml.safe_dump(GPU_SPEC if cuda else SPEC))
        on: list[float] = []
        off: list[float] = []
        snaps: list[dict[str, float]] = []
        for i in range(pairs()):  # off, on / on, off / ...: neither side always runs first
            order = ("off", "on") if i % 2 == 0 else ("on", "off")
            for side in order:
                if side == "off":
                    off += _one_run(tmp, f"off-{i}", ["--plain"], world)
                else:
                    on += _one_run(tmp, f"on-{i}", [], world, agent, snaps)
    value, floor = statistics.median(on), statistics.median(off)
    # steady state: one snapshot's measured cost (copy, waits, background CPU) over the interval auto chose
    per_step = [
        (r["copy_s"] + r["wait_s"] + r["background_s"]) / r["taken"] / r["every"] for r in snaps if r["taken"]
    ]
    snapshot_s = statistics.median(per_step) if per_step else 0.0
    return result(
        "overhead",
        value,
        floor,
        "s/step",
        "ratio <= 1.03 (CPU, step >= 50 ms)",
        steps_measured=len(on),
        mean_on_s=round(statistics.fmean(on), 6),
        mean_off_s=round(statistics.fmean(off), 6),
        snapshot_cost_s_per_step=round(snapshot_s, 6),
        snapshot_every=sorted({int(r["every"]) for r in snaps}),
        snapshot_ratio=round((floor + snapshot_s) / floor, 4),
        config=config,
    )
