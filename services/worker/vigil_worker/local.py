"""Run a job's ranks on this machine without a worker: for benchmarks, demos and debugging.

The worker is the production path (`agent.py`, `launch.py`); this starts the same rank program with the same
torch.distributed environment, from an argument list.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from vigil_common.embedded import free_port


@dataclass
class LocalRanks:
    procs: list[subprocess.Popen[bytes]]
    logs: list[Path]

    def wait(self, timeout_s: float) -> list[int]:
        return [p.wait(timeout_s) for p in self.procs]

    def kill(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
        for p in self.procs:
            p.wait()

    def tail(self, n: int = 3000) -> str:
        return "\n".join(log.read_text(errors="replace")[-n:] for log in self.logs if log.exists())


def start_ranks(
    args: list[str],
    world_size: int,
    log_dir: Path,
    *,
    threads: int = 1,
    module: str = "vigil_worker.trainer",
) -> LocalRanks:
    """Start `world_size` ranks of `python -m MODULE ARGS` here, logs in `log_dir`. MODULE is the rank
    program, or one that wraps it (a benchmark's, calling `vigil_worker.trainer.rank.main`)."""
    log_dir.mkdir(parents=True, exist_ok=True)
    port = free_port()
    procs, logs = [], []
    for rank in range(world_size):
        env = dict(os.environ)
        env.update(
            RANK=str(rank),
            WORLD_SIZE=str(world_size),
            LOCAL_RANK=str(rank),
            LOCAL_WORLD_SIZE=str(world_size),
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(port),
            OMP_NUM_THREADS=str(threads),
            PYTHONUNBUFFERED="1",
        )
        log = log_dir / f"rank-{rank}.log"
        with log.open("ab") as out:
            procs.append(
                subprocess.Popen(
                    [sys.executable, "-m", module, *args],
                    env=env,
                    stdin=subprocess.DEVNULL,
                    stdout=out,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                )
            )
        logs.append(log)
    return LocalRanks(procs, logs)
