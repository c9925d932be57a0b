"""`vigil worker` processes in namespace hosts (`netns.Host`): what the `multihost` tests and `vigil bench
elastic` start in their hosts, stop, and kill as a machine dies."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

from vigil_bench.netns import Host
from vigil_worker.warm import STANDBY_MODULE

VIGIL = str(Path(sys.executable).parent / "vigil")


def cannot_make_hosts() -> str | None:
    """Why namespace hosts cannot be made here, or None."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    missing = [b for b in ("ip", "nsenter", "unshare") if not shutil.which(b)]
    if missing:
        return (
            f"{', '.join(missing)} not found: scripts/install.sh installs iproute2 (ip); "
            "util-linux has the rest"
        )
    return None


@dataclass
class HostWorker:
    host: Host
    node: str
    proc: subprocess.Popen[bytes]
    log: Path


@dataclass
class Workers:
    """`vigil worker` processes started in the hosts by one test or bench run, on a data dir they share (as
    nodes share checkpoint storage); `stop()` ends them and whatever their ranks left running."""

    nats_url: str
    data_dir: Path
    started: list[HostWorker] = field(default_factory=list)

    def start(self, host: Host, *, slots: int = 1, node: str | None = None, **env: str) -> HostWorker:
        """A worker in `host`, advertising the host's address; named after the host (its UTS host name,
        Vigil's default node name) unless `node` is given."""
        full = {k: v for k, v in os.environ.items() if not k.startswith("VIGIL_")}
        full.update(
            VIGIL_NATS_URL=self.nats_url,
            VIGIL_DATA_DIR=str(self.data_dir),
            VIGIL_NODE_ADDRESS=host.address,
            VIGIL_CPU_SLOTS=str(slots),
            VIGIL_HEARTBEAT_INTERVAL_S="0.5",
            VIGIL_GPU_SAMPLE_INTERVAL_S="1",
            OMP_NUM_THREADS="1",  # the hosts share this machine's cores
            **env,
        )
        if node is not None:
            full["VIGIL_NODE_NAME"] = node
        log = self.data_dir / f"worker-{node or host.hostname}-{len(self.started)}.log"
        with log.open("ab") as out:
            proc = host.popen([VIGIL, "worker"], env=full, stdout=out, stderr=subprocess.STDOUT)
        worker = HostWorker(host, node or host.hostname, proc, log)
        self.started.append(worker)
        return worker

    def logs(self) -> str:
        return "\n".join(
            f"== {w.log.name}\n{w.log.read_text(errors='replace')[-3000:]}" for w in self.started
        )

    def kill(self, host: Host) -> None:
        """SIGKILL the workers started in `host` and their ranks (the machine dies)."""
        for w in self.started:
            if w.host is host and w.proc.poll() is None:
                w.proc.kill()
                w.proc.wait()
        self._kill_ranks(host)

    def _kill_ranks(self, host: Host) -> None:
        """Ranks outlive their worker by design: end this run's (their command lines name its data dir)
        and the warm ranks in the host (a launched one runs a job's rank under the standby's command line;
        the workers of the runs before closed theirs)."""
        marks = (str(self.data_dir).encode(), STANDBY_MODULE.encode())
        for pid in host.pids():
            with contextlib.suppress(OSError):
                if any(mark in Path(f"/proc/{pid}/cmdline").read_bytes() for mark in marks):
                    os.kill(pid, signal.SIGKILL)

    def stop(self) -> None:
        for w in self.started:
            if w.proc.poll() is None:
                w.proc.send_signal(signal.SIGTERM)
        for w in self.started:
            try:
                w.proc.wait(20)
            except subprocess.TimeoutExpired:
                w.proc.kill()
                w.proc.wait()
        for host in {w.host.netns: w.host for w in self.started}.values():
            self._kill_ranks(host)
