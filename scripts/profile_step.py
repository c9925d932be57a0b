"""Where one rank's training step spends its time: the built-in trainer's rank, alone (world 1, no agent),
sampled by py-spy, each sample put in the phase of the step it was taken in.

    python scripts/profile_step.py [--preset tiny] [--micro-batch 8] [--steps 80] [--rate 250]

Run it from a checkout; to profile another commit, put that checkout's folders first on PYTHONPATH (the
script only starts `python -m vigil_trainer` and reads py-spy's stacks, so it runs against any
version of the trainer). Only samples inside the training loop count (no setup; the first step's warm-up
is in, one of --steps), idle samples are left out (py-spy without --idle): the shares are of the CPU the
rank's threads used in its steps. Prints a table of milliseconds per step and shares, and its JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import yaml

# (phase, what a frame's function name is, what its file path holds): the first rule that matches a frame,
# looking from the outermost frame of the loop inwards, names the sample's phase
RULES: list[tuple[str, str | None, str | None]] = [
    ("checkpoint", None, "checkpoint"),
    ("report (events)", None, "trainer/report.py"),
    ("data", "batch", "trainer/data.py"),
    ("forward", "forward", None),
    ("backward", "backward", None),
    ("optimizer step", "step", "deepspeed/runtime/engine.py"),
    ("optimizer step", "skip_step", None),
    ("optimizer step", "step", "torch/optim"),
    ("boundary (guard, all-reduce)", None, "trainer/guard.py"),
    ("boundary (guard, all-reduce)", "all_reduce", None),
    ("host sync", "sync", "trainer/clock.py"),
    ("step judge", None, "trainer/step_judge.py"),
]
LOOP = "loop.py"


def phase_of(frames: list[str]) -> str | None:
    """The phase of one sample (frames outermost first, as py-spy's raw format writes them), None when
    the sample is outside the training loop."""
    inside = False
    for frame in frames:
        name, _, where = frame.partition(" (")
        if not inside:
            inside = name == "train" and LOOP in where
            continue
        for phase, func, path in RULES:
            named = func is None or name == func or name.endswith("." + func)  # py-spy: Class.method
            if named and (path is None or path in where):
                return phase
    return "other (loop, bookkeeping)" if inside else None


def profile(
    preset: str, micro_batch: int, steps: int, rate: int, tmp: Path, keep: Path | None = None
) -> dict[str, object]:
    spec = {
        "name": "profile",
        "resources": {"gpus_per_node": 1},
        "model": {"preset": preset},
        "train": {"steps": steps, "micro_batch": micro_batch, "warmup_steps": 2},
        "checkpoint": {"every": 1_000_000, "keep": 1},
    }
    (tmp / "spec.yaml").write_text(yaml.safe_dump(spec))
    env = {k: v for k, v in os.environ.items() if not k.startswith("VIGIL_")}
    env.update(
        RANK="0",
        WORLD_SIZE="1",
        LOCAL_RANK="0",
        LOCAL_WORLD_SIZE="1",
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(29500 + os.getpid() % 1000),
        OMP_NUM_THREADS="1",
        PYTHONUNBUFFERED="1",
    )
    rank = [
        sys.executable,
        "-m",
        "vigil_trainer",
        "--spec",
        str(tmp / "spec.yaml"),
        "--job-id",
        "profile",
        "--checkpoint-root",
        str(tmp / "ckpt"),
        "--cache-dir",
        str(tmp / "cache"),
    ]
    raw = tmp / "stacks.txt"
    py_spy = shutil.which("py-spy") or str(Path(sys.executable).with_name("py-spy"))
    started = time.monotonic()
    out = subprocess.run(
        [py_spy, "record", "--format", "raw", "--rate", str(rate), "--output", str(raw), "--", *rank],
        env=env,
        capture_output=True,
        text=True,
        timeout=1800,
    )
    if out.returncode != 0:
        raise SystemExit(
            f"the rank or py-spy failed ({out.returncode}):\n{(out.stdout + out.stderr)[-3000:]}"
        )
    if keep is not None:
        shutil.copy(raw, keep)
    samples: Counter[str] = Counter()
    for line in raw.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if (phase := phase_of(stack.split(";"))) is not None:
            samples[phase] += int(count)
    total = sum(samples.values())
    ms_per_sample = 1000.0 / rate
    return {
        "preset": preset,
        "micro_batch": micro_batch,
        "steps": steps,
        "rate_hz": rate,
        "wall_s": round(time.monotonic() - started, 1),
        "phases": {
            phase: {"ms_per_step": round(n * ms_per_sample / steps, 2), "share": round(n / total, 4)}
            for phase, n in samples.most_common()
        },
        "ms_per_step": round(total * ms_per_sample / steps, 2),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="tiny")
    p.add_argument("--micro-batch", type=int, default=8)
    p.add_argument("--steps", type=int, default=80)
    p.add_argument("--rate", type=int, default=250, help="py-spy samples per second")
    p.add_argument("--stacks", type=Path, help="keep py-spy's raw stacks here")
    args = p.parse_args()
    with tempfile.TemporaryDirectory(prefix="vigil-profile-") as tmp:
        got = profile(args.preset, args.micro_batch, args.steps, args.rate, Path(tmp), args.stacks)
    print(f"{'phase':32} {'ms/step':>8} {'share':>7}")
    for phase, row in got["phases"].items():  # type: ignore[union-attr]
        print(f"{phase:32} {row['ms_per_step']:8.2f} {row['share']:7.1%}")
    print(f"{'all (CPU of the step thread)':32} {got['ms_per_step']:8.2f}")
    print(json.dumps(got))


if __name__ == "__main__":
    main()
