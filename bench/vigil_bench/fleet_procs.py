"""The processes of `vigil bench fleet` (services and simulators, each with its stderr kept) and what
they cost: CPU seconds per process from /proc, and the whole machine's busy share."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from vigil_common.embedded import EmbeddedNats, EmbeddedPostgres

SERVICE = (
    "import sys; from vigil_common.service import run_service; from vigil_common.settings import Settings; "
    "import importlib; run_service(importlib.import_module(sys.argv[1]).run, Settings.load())"
)
SIMULATOR = (
    "import sys; from vigil_bench.fleet_sim import simulate_main as m; "
    "m(sys.argv[1], *map(int, sys.argv[2:4]), *map(float, sys.argv[4:6]), int(sys.argv[6]))"
)


@dataclass
class Procs:
    logs: Path  # each process's stderr, as <name>.log
    named: dict[str, asyncio.subprocess.Process] = field(default_factory=dict)

    async def start(
        self, name: str, *args: str, env: dict[str, str], stdout: Any = None
    ) -> asyncio.subprocess.Process:
        self.logs.mkdir(parents=True, exist_ok=True)
        with (self.logs / f"{name}.log").open("ab") as log:
            proc = await asyncio.create_subprocess_exec(
                sys.executable, "-c", *args, env=env, stdout=stdout, stderr=log
            )
        self.named[name] = proc
        return proc

    def log_counts(self) -> dict[str, dict[str, int]]:
        """Per process, its log's lines that tell of trouble (nats-py's slow-consumer drops, errors)."""
        out = {}
        for name in self.named:
            text = (self.logs / f"{name}.log").read_text(errors="replace").lower()
            counts = {
                "slow_consumer": text.count("slow consumer"),
                "errors": text.count(" error ") + text.count("traceback"),
                "warnings": text.count(" warning "),
            }
            if any(counts.values()):
                out[name] = counts
        return out

    async def stop(self, names: list[str] | None = None) -> None:
        chosen = [self.named[n] for n in (names or list(self.named))]
        for proc in chosen:
            if proc.returncode is None:
                proc.send_signal(signal.SIGTERM)
        for proc in chosen:
            try:
                await asyncio.wait_for(proc.wait(), 30)
            except TimeoutError:
                proc.kill()


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of one process (0 when it is gone)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def postgres_pids(pgdata: Path) -> list[int]:
    try:
        master = int((pgdata / "postmaster.pid").read_text().split("\n", 1)[0])
    except (OSError, ValueError):
        return []
    pids = [master]
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError, IndexError, ValueError):
            if int(stat.read_text().rsplit(")", 1)[1].split()[1]) == master:
                pids.append(int(stat.parent.name))
    return pids


def loadavg() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


def cpu(procs: Procs, nats_server: EmbeddedNats, pg: EmbeddedPostgres) -> dict[str, float]:
    """CPU seconds so far of every process of the run: each started one, nats-server, Postgres (all its
    backends) and this bench's own process (its probes and sampling)."""
    out = {name: cpu_seconds(p.pid) for name, p in procs.named.items()}
    if nats_server.proc is not None:
        out["nats-server"] = cpu_seconds(nats_server.proc.pid)
    out["postgres"] = sum(cpu_seconds(pid) for pid in postgres_pids(pg.pgdata))
    out["bench"] = cpu_seconds(os.getpid())
    return out


def machine_ticks() -> tuple[int, int]:
    """(busy, total) clock ticks of every core since boot (/proc/stat): whoever spent them."""
    # user nice system idle iowait irq softirq steal (guest time is inside user and nice already)
    fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:9]]
    idle = fields[3] + fields[4]
    return sum(fields) - idle, sum(fields)


def machine_busy(before: tuple[int, int], after: tuple[int, int]) -> float:
    """The share (0..1) of the machine's cores busy between two `machine_ticks`, our processes or not."""
    total = after[1] - before[1]
    return (after[0] - before[0]) / total if total else 0.0
