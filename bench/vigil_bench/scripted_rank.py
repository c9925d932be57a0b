"""One rank of the built-in trainer under a scripted agent: the GPU check's snapshot and rollback check
(`gpu_recovery.snapshot_rollback_on_device`) runs it.

`python -m vigil_bench.scripted_rank --out EVENTS.jsonl [--fault-after K --rollback-to S] -- TRAINER ARGS`
runs `rank.main(TRAINER ARGS)`, the trainer's own rank, with a `ScriptedLink` for its link to an agent:
each step's loss, each halt and each rollback go to EVENTS.jsonl as they happen (one JSON line each, so
that an injected crash loses none). With `--fault-after K`: once step K of the first run is reported,
the link hands the ranks a halt and then a rollback to step S (a disk checkpoint's step, which the
trainer also keeps in memory); between the two, while the ranks are held, it spoils the engine's state
in place (NaN in the module's weights, in the ZeRO optimizer's fp32 partition and in its moments; the
RNG reseeded): what the rollback must undo, from memory. The last line is the rollback's timing
(`Run.last_rollback`: `from_memory`, `load_s`).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path
from typing import Any

import torch

from vigil import events as ev
from vigil import link as vigil_link
from vigil import protocol as proto
from vigil.recovery import Rollback
from vigil.snapshot import SnapshotCost
from vigil_trainer import rank


class ScriptedLink:
    """A `vigil.link.Link` with no agent: events go to a file, commands come from the script."""

    dropped = 0
    last_step: int | None = None

    def __init__(self, out: Path, fault_after: int | None, rollback_to: int | None, root: Path) -> None:
        self.out = out.open("a", buffering=1)
        self.fault_after, self.rollback_to, self.root = fault_after, rollback_to, root
        self.commands: list[proto.RankCommand] = []
        self.engine: Any = None  # the rank's engine, once built (`main` hands it over)

    def write(self, record: dict[str, Any]) -> None:
        self.out.write(json.dumps(record) + "\n")

    def emit(self, event: ev.Message) -> None:
        if isinstance(event, ev.StepCompleted):
            self.last_step = event.step
            self.write(
                {"event": "step", "step": event.step, "generation": event.generation, "loss": event.loss}
            )
            if event.step == self.fault_after and event.generation == 0 and not self.commands:
                self._script(event)
        elif isinstance(event, ev.RanksHalted | ev.RollbackCompleted | ev.CheckpointSaved):
            self.write({"event": event.type, **event.model_dump(mode="json", include=_FIELDS)})

    def _script(self, event: ev.StepCompleted) -> None:
        from vigil_trainer import checkpoint as ckpt

        assert self.rollback_to is not None
        job, attempt = event.job_id, event.attempt
        target = ckpt.step_dir(self.root, str(job), self.rollback_to)
        self.commands += [
            ev.HaltJob(job_id=job, attempt=attempt, reason="gpu check: a fault"),
            ev.RollbackJob(
                job_id=job,
                attempt=attempt,
                checkpoint=str(target),
                step=self.rollback_to,
                skip_data=None,
                reason="gpu check",
            ),
        ]

    @property
    def latest_seq(self) -> int:
        return len(self.commands)

    def command(self, seq: int, timeout_s: float) -> proto.RankCommand:
        command = self.commands[seq - 1]
        if isinstance(command, ev.RollbackJob):  # the ranks are held: the fault strikes now
            spoil(self.engine)
            self.write({"event": "spoiled", "nan_params": nan_count(self.engine)})
        return command

    def arrival(self, seq: int) -> float | None:
        return None

    def flush(self, timeout_s: float = 30.0) -> bool:
        return True

    def close(self, timeout_s: float = 10.0) -> None:
        self.out.flush()


_FIELDS = {"step", "from_step", "to_step", "checkpoint", "path"}


def spoil(engine: Any) -> None:
    """NaN into every tensor of the engine's state a snapshot must restore, in place; the RNG reseeded."""
    nan = float("nan")
    with torch.no_grad():
        for p in engine.module.parameters():
            p.fill_(nan)
        opt = engine.optimizer
        for flat in getattr(opt, "single_partition_of_fp32_groups", []):  # ZeRO 1 and 2: the fp32 master
            flat.fill_(nan)
        inner = getattr(opt, "optimizer", opt)  # ZeRO's wrapped torch optimizer: Adam's moments
        for state in inner.state.values():
            for value in state.values():
                if torch.is_tensor(value) and value.is_floating_point() and value.dim() > 0:
                    value.fill_(nan)
    torch.manual_seed(12345)
    if torch.cuda.is_available():
        torch.cuda.manual_seed_all(12345)


def nan_count(engine: Any) -> int:
    return sum(int(torch.isnan(p).any()) for p in engine.module.parameters())


class Timings:
    """The rank's observer: each in-place rollback's timing goes to the file."""

    def __init__(self, link: ScriptedLink) -> None:
        self.link = link

    def on_step_end(self, step: int, seconds: float) -> None:
        pass

    def on_rollback(self, timing: Rollback) -> None:
        self.link.write({"event": "rollback", **dataclasses.asdict(timing)})

    def on_snapshots(self, every: int, steps: int, cost: SnapshotCost) -> None:
        self.link.write({"event": "snapshots", "every": every, "taken": cost.taken, "copy_s": cost.copy_s})


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m vigil_bench.scripted_rank", description=__doc__)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--fault-after", type=int)
    p.add_argument("--rollback-to", type=int)
    p.add_argument("trainer", nargs=argparse.REMAINDER, help="-- then the trainer's arguments")
    args = p.parse_args(argv)
    trainer_argv = args.trainer[1:] if args.trainer[:1] == ["--"] else args.trainer
    root = rank.parse_args(trainer_argv).checkpoint_root.resolve()
    link = ScriptedLink(args.out, args.fault_after, args.rollback_to, root)

    # the rank as the trainer builds it, with this link for its agent's, and its engine handed over
    vigil_link.connect_from_env = lambda *_: link  # type: ignore[assignment]
    build_engine = rank.build_engine

    def built(*a: Any, **kw: Any) -> Any:
        engine, plan = build_engine(*a, **kw)
        link.engine = engine
        return engine, plan

    rank.build_engine = built  # type: ignore[assignment]
    return rank.main(trainer_argv, observer=Timings(link))


if __name__ == "__main__":
    rank.exit_process(main())
