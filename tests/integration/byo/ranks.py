"""Start a program as torchrun would, one process per rank, without Vigil: the SDK is inert."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from vigil import protocol as proto
from vigil_common.embedded import free_port

EXAMPLES = Path(__file__).resolve().parents[3] / "examples" / "byo"


@dataclass
class Rank:
    rank: int
    code: int
    output: str

    @property
    def result(self) -> dict[str, Any]:
        """The JSON object the example prints last."""
        last = [line for line in self.output.splitlines() if line.startswith("{")][-1]
        return json.loads(last)


def torchrun(
    script: str,
    *args: str,
    world: int = 2,
    cwd: Path,
    timeout_s: float = 240,
    extra_env: Mapping[str, str] | None = None,
) -> list[Rank]:
    """Run `examples/byo/<script>` (or the script at an absolute path) as `world` ranks on this host (gloo,
    CPU), with `extra_env` added to their environment, and wait for all of them."""
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("VIGIL_") or k == "VIGIL_LOG_LEVEL"}
    for name in (proto.AGENT_SOCKET_ENV, proto.JOB_ID_ENV, proto.RANK_TOKEN_FD_ENV):
        env.pop(name, None)
    env.update(
        WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world), NODE_RANK="0", MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port), OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", CUDA_VISIBLE_DEVICES="",
        DS_ACCELERATOR="cpu", PYTHONUNBUFFERED="1",
    )  # fmt: skip
    env.update(extra_env or {})
    procs = []
    for rank in range(world):
        log = (cwd / f"rank-{rank}.log").open("w")
        procs.append(
            subprocess.Popen(
                [sys.executable, str(EXAMPLES / script), *args],
                cwd=cwd,
                env={**env, "RANK": str(rank), "LOCAL_RANK": str(rank)},
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        )
    try:
        codes = [p.wait(timeout=timeout_s) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    return [Rank(r, c, (cwd / f"rank-{r}.log").read_text()) for r, c in enumerate(codes)]
