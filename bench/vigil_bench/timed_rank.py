"""The rank program as the overhead and recovery benches run it, with timings written to a file.

`python -m vigil_bench.timed_rank --timings FILE [--plain] TRAINER-ARGS...`: without `--plain`, the
trainer's own rank (`vigil_trainer.rank.main`) with an observer that appends each step's wall
time, each in-place rollback's timing and the in-memory snapshots' cost to FILE as JSON lines (every rank
to the same file, each line naming its rank). With `--plain`, the overhead bench's baseline: the same
engine, model and data, built by the trainer's own setup functions, stepped by a plain DeepSpeed loop
with nothing of Vigil's (no guard, section timers, comm timer, events, commands or checkpoints). With
`--ceiling`, the mfu bench's ceiling (`vigil_bench.ceiling`): the same model and data in a plain PyTorch
loop, no DeepSpeed at all.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections import deque
from pathlib import Path
from typing import Any

from vigil.recovery import Rollback
from vigil.snapshot import SnapshotCost
from vigil_trainer import rank
from vigil_trainer.observer import Observer


class JsonLinesObserver:
    """Step and rollback timings as JSON lines, each written (line-buffered) as it happens, so that a
    killed rank leaves every record it made."""

    def __init__(self, path: Path, rank: int) -> None:
        self.rank = rank
        self._out = path.open("a", buffering=1)
        self._step_ends: deque[float] = deque(maxlen=8)  # time.monotonic() at the end of recent steps

    def on_step_end(self, step: int, seconds: float) -> None:
        self._step_ends.append(time.monotonic())
        self._write({"event": "step", "step": step, "seconds": seconds})

    def on_rollback(self, timing: Rollback) -> None:
        record: dict[str, Any] = {
            "event": "rollback",
            "to_step": timing.to_step,
            "load_s": timing.load_s,
            "total_s": timing.total_s,
        }
        if timing.arrived is not None:
            # waited: command arrival to acting on it. in_flight: arrival to the end of the step that was
            # running then, which any in-place rollback has to let finish (ranks cannot leave mid-collective)
            ends = [e for e in self._step_ends if e >= timing.arrived]
            record["waited_s"] = timing.acted - timing.arrived
            record["in_flight_s"] = (ends[0] if ends else timing.acted) - timing.arrived
        self._write(record)

    def on_snapshots(self, every: int, steps: int, cost: SnapshotCost) -> None:
        self._write(
            {
                "event": "snapshots",
                "every": every,
                "steps": steps,
                "taken": cost.taken,
                "copy_s": cost.copy_s,
                "wait_s": cost.wait_s,
                "background_s": cost.background_s,
            }
        )

    def _write(self, record: dict[str, Any]) -> None:
        self._out.write(json.dumps({"rank": self.rank, **record}) + "\n")


def plain(argv: list[str], observer: Observer) -> int:
    """Plain DeepSpeed on the trainer's engine, model and data: the overhead bench's "off"."""
    args = rank.parse_args(argv)
    env = rank.rank_env()
    job = rank.read_job(args, env.world)
    device = rank.init_process_group(env)
    engine, plan = rank.build_engine(job.spec, env, device)
    tokens = rank.load_data(args, job.spec)

    import torch
    import torch.distributed as dist

    from vigil_trainer.data import batch

    # where DeepSpeed steps the trainer's optimizer (no ZeRO), the trainer clips
    clip = job.spec.train.grad_clip if plan.owns_step else 0.0

    train, seq_len = job.spec.train, job.spec.model.resolved().seq_len
    for step in range(train.steps):
        t0 = time.perf_counter()
        for micro in range(train.grad_accum):
            x, y = batch(
                tokens,
                seed=train.seed,
                data_position=step,  # the trainer's data positions, with no skip windows
                rank=env.rank,
                micro=micro,
                micro_batch=train.micro_batch,
                seq_len=seq_len,
            )  # (B, T) each
            loss = engine(x.to(device), y.to(device))
            engine.backward(loss)
            if clip > 0 and micro == train.grad_accum - 1:
                torch.nn.utils.clip_grad_norm_(engine.module.parameters(), clip)
            engine.step()  # DeepSpeed updates the weights at the accumulation boundary only
        if device.type == "cuda":
            torch.cuda.synchronize()  # CPU-GPU sync point: the step's wall time is honest only after one
        observer.on_step_end(step, time.perf_counter() - t0)
    dist.barrier()
    dist.destroy_process_group()
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m vigil_bench.timed_rank",
        description=__doc__.split("\n\n")[0],
        allow_abbrev=False,
    )
    p.add_argument("--timings", type=Path, required=True, help="append JSON lines here")
    how = p.add_mutually_exclusive_group()
    how.add_argument("--plain", action="store_true", help="a plain DeepSpeed loop: the overhead baseline")
    how.add_argument("--ceiling", action="store_true", help="a plain PyTorch loop: the mfu bench's ceiling")
    ours, trainer_args = p.parse_known_args(argv)
    observer = JsonLinesObserver(ours.timings, int(os.environ.get("RANK", "0")))
    if ours.plain:
        return plain(trainer_args, observer)
    if ours.ceiling:
        from vigil_bench.ceiling import ceiling

        return ceiling(trainer_args, observer)
    return rank.main(trainer_args, observer=observer)


if __name__ == "__main__":
    sys.exit(main())
