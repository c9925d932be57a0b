"""Run a job's ranks on this machine without a worker: for benchmarks, demos and debugging.

The worker is the production path (`agent.py`, `launch.py`); this starts the same rank program with the same
torch.distributed environment, from an argument list. With a `LocalAgent` the ranks are linked to the bus
as a worker's are: through the agent's relay (its own thread, event loop and bus connection).
"""

from __future__ import annotations

import asyncio
import os
import secrets
import signal
import subprocess
import sys
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path

from vigil import protocol as proto
from vigil_common.bus import Bus
from vigil_common.embedded import free_port
from vigil_worker.procs import RankRecord
from vigil_worker.relay import Relay


class LocalAgent:
    """The relay of a worker, for ranks started by `start_ranks`: `env(job, attempt, rank)` is what a rank
    needs to link to it, and the rank's fresh token (which reaches the rank on a pipe, as a worker's do)."""

    def __init__(self, nats_url: str, checkpoint_root: Path, node: str = "local") -> None:
        self.nats_url, self.checkpoint_root, self.node = nats_url, checkpoint_root, node
        self.socket_path = Path(tempfile.mkdtemp(prefix="vigil-agent-")) / "agent.sock"
        self._ranks: dict[tuple[str, int, int], RankRecord] = {}
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="local-agent", daemon=True)
        self._relay: Relay | None = None
        self._bus: Bus | None = None

    def __enter__(self) -> LocalAgent:
        self._thread.start()
        asyncio.run_coroutine_threadsafe(self._start(), self._loop).result(60)
        return self

    def __exit__(self, *exc: object) -> None:
        asyncio.run_coroutine_threadsafe(self._stop(), self._loop).result(60)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)

    async def _start(self) -> None:
        self._bus = await Bus.connect(self.nats_url, name=f"agent-{self.node}")
        await self._bus.ensure_streams()  # as a worker's start does: the relay's publishes need them
        self._relay = await Relay(
            self._bus, self.node, self.socket_path, self.checkpoint_root, self._find
        ).start()

    async def _stop(self) -> None:
        if self._relay is not None:
            await self._relay.close()
        if self._bus is not None:
            await self._bus.close()

    def _find(self, job_id: str, attempt: int, rank: int) -> RankRecord | None:
        return self._ranks.get((job_id, attempt, rank))

    def env(self, job_id: str, attempt: int, rank: int) -> tuple[dict[str, str], str]:
        token = secrets.token_urlsafe(32)
        self._ranks[(job_id, attempt, rank)] = RankRecord(
            job_id=job_id, attempt=attempt, rank=rank, device=rank, pid=0, ticks=0, log_path="", exit_path="",
            token=token,
        )  # fmt: skip
        env = {
            proto.AGENT_SOCKET_ENV: str(self.socket_path),
            proto.JOB_ID_ENV: job_id,
            proto.ATTEMPT_ENV: str(attempt),
            proto.NODE_ENV: self.node,
        }
        return env, token


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
    module: str = "vigil_trainer",
    agent: LocalAgent | None = None,
    job: tuple[str, int] | None = None,
    snapshot_dir: Path | None = None,
) -> LocalRanks:
    """Start `world_size` ranks of `python -m MODULE ARGS` here, logs in `log_dir`. MODULE is the rank
    program, or one that wraps it (a benchmark's, calling `vigil_trainer.rank.main`). With
    `agent` and `job` (job id, attempt) the ranks are linked to the bus through that agent; with
    `snapshot_dir` their in-memory snapshots go there (and to each other), as a worker's do."""
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
        for name in [k for k in env if k.startswith("VIGIL_")]:
            del env[name]  # this process's settings are not the rank's
        token = ""
        if agent is not None and job is not None:
            link, token = agent.env(job[0], job[1], rank)
            env.update(link)
        if snapshot_dir is not None:
            env[proto.SNAPSHOT_DIR_ENV] = str(snapshot_dir)
        log = log_dir / f"rank-{rank}.log"
        read_end, write_end = os.pipe()  # the token, as a worker hands it over (never in the environment)
        os.write(write_end, token.encode())
        os.close(write_end)
        try:
            with log.open("ab") as out:
                procs.append(
                    subprocess.Popen(
                        [sys.executable, "-m", module, *args],
                        env={**env, proto.RANK_TOKEN_FD_ENV: str(read_end)} if token else env,
                        stdin=subprocess.DEVNULL,
                        stdout=out,
                        stderr=subprocess.STDOUT,
                        start_new_session=True,
                        pass_fds=(read_end,) if token else (),
                    )
                )
        finally:
            os.close(read_end)
        logs.append(log)
    return LocalRanks(procs, logs)
