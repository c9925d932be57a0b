"""The faults the examples inject to show Vigil recovering, each at most once per job: a marker file in
the job's checkpoint folder (which outlives a relaunch) says it fired. Outside Vigil the markers go under
`--out`.

- `--nan-at K`: rank 1's loss is NaN at step K (each example poisons its own loss); `--nan-rank R` picks
  another rank (0 in a one-rank run);
- `--crash-at K`: rank 1 dies at step K with exit code 17, as a bug in a user program or a lost process
  would end it; Vigil relaunches the job from its newest checkpoint;
- `--startup-delay S`: every rank of a relaunch (attempt 2 on) sleeps S seconds before it starts,
  standing in for the imports and the checkpoint load of a large model (the relaunch then takes that long
  to its first step; the first attempt's start-up is left alone, so a short run stays short).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import vigil
from vigil.identity import Identity

CRASH_EXIT_CODE = 17


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--nan-at", type=int, default=None, help="rank 1's loss is NaN at this step, once")
    p.add_argument("--nan-rank", type=int, default=1, help="the rank whose loss --nan-at poisons (1)")
    p.add_argument("--crash-at", type=int, default=None, help="rank 1 dies at this step, once (exit 17)")
    p.add_argument(
        "--startup-delay", type=float, default=0.0, help="seconds each rank of a relaunch sleeps at its start"
    )


def start_slowly(args: argparse.Namespace) -> None:
    """The heavy imports and loads a large model's program makes before its first step (`--startup-delay`),
    on a relaunch."""
    identity = Identity.from_env()
    if args.startup_delay > 0 and identity is not None and identity.attempt > 1:
        print(f"faults: starting slowly ({args.startup_delay:g}s)", flush=True)
        time.sleep(args.startup_delay)


def marker_dir(run: vigil.Run, out: str) -> Path:
    """Where the markers go: the job's checkpoint folder under Vigil (it outlives a relaunch), else `out`."""
    if run.active and run.checkpoint_root is not None:
        return run.checkpoint_root / run.identity.job_id
    return Path(out)


def once(marker: Path) -> bool:
    """True the first time it is asked about `marker` in this job (it then leaves the marker)."""
    if marker.exists():
        return False
    marker.parent.mkdir(parents=True, exist_ok=True)
    marker.touch()
    return True


def crash_if_due(args: argparse.Namespace, step: int, rank: int, markers: Path) -> None:
    """Rank 1 dies at step `--crash-at`, once per job: no exception handler, no teardown."""
    if args.crash_at != step or rank != 1 or not once(markers / f"crash-at-{step}.done"):
        return
    print(f"faults: rank {rank} crashes at step {step} (exit code {CRASH_EXIT_CODE})", file=sys.stderr)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(CRASH_EXIT_CODE)
