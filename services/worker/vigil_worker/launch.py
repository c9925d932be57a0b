"""How a LaunchJob becomes this node's rank processes: the run directory, each rank's argv and env.

A launch's run directory is `<data dir>/runs/<job>/attempt-<n>/`: the launch event as `launch.json`
(what every rank reads) and each rank's exit file. Logs go to `<log dir>/<job>/`. Every value on a
rank's command line comes from Vigil, none from a shell, and none is a secret: a rank's command line
is readable by every local user (`ps`), so the NATS URL, which may hold a password, travels in its
environment (`RANK_NATS_URL_ENV`, readable only by its own user), and the worker's other secrets
(the database URL, the API token) are not passed on at all.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from pathlib import Path

from vigil_common.events import LaunchJob, RankPlacement
from vigil_common.settings import Settings

RANK_NATS_URL_ENV = "VIGIL_RANK_NATS_URL"  # where a rank finds its NATS URL (`vigil_worker.trainer.rank`)
RANK_NATS_TLS_CA_ENV = "VIGIL_NATS_TLS_CA"  # and the CA of a NATS server with a private one
# the worker's secrets that a rank has no use for
_NOT_FOR_RANKS = ("VIGIL_DATABASE_URL", "VIGIL_API_TOKEN", "VIGIL_NATS_URL")


@dataclass(frozen=True)
class RankLaunch:
    """One rank of a launch, ready to start."""

    placement: RankPlacement
    argv: list[str]
    env: dict[str, str]
    log_path: Path
    exit_path: Path


def prepare_ranks(launch: LaunchJob, settings: Settings, kind: str) -> list[RankLaunch]:
    """This node's ranks of `launch` (none if it places nothing here), its run directory written.

    `kind` is this node's device kind ("gpu" or "cpu")."""
    mine = [p for p in launch.placement if p.node == settings.node_name]
    if not mine:
        return []
    job = str(launch.job_id)
    run_dir = settings.data_dir.resolve() / "runs" / job / f"attempt-{launch.attempt}"
    run_dir.mkdir(parents=True, exist_ok=True)
    launch_file = run_dir / "launch.json"
    launch_file.write_bytes(launch.to_bytes())
    ranks = []
    for p in mine:
        exit_path = run_dir / f"rank-{p.rank}.exit"
        ranks.append(
            RankLaunch(
                placement=p,
                argv=rank_argv(launch_file, settings),
                env=rank_env(launch, p, len(mine), kind, settings, exit_path),
                log_path=settings.log_dir / job / f"attempt-{launch.attempt}-rank-{p.rank}.log",
                exit_path=exit_path,
            )
        )
    return ranks


def rank_argv(launch_file: Path, settings: Settings) -> list[str]:
    """The rank program's command line: an argument list, every value from Vigil, none from a shell, none
    secret."""
    argv = [
        sys.executable, "-m", "vigil_worker.trainer",
        "--launch", str(launch_file),
        "--checkpoint-root", str(settings.checkpoint_root),
        "--cache-dir", str((settings.data_dir / "cache").resolve()),
        "--node", settings.node_name,
    ]  # fmt: skip
    for root in settings.allowed_data_roots:
        argv += ["--data-root", str(root)]
    return argv


def rank_env(
    launch: LaunchJob,
    placement: RankPlacement,
    local_world: int,
    kind: str,
    settings: Settings,
    exit_path: Path,
) -> dict[str, str]:
    """The torch.distributed environment for one rank and its NATS URL, on top of the worker's own
    environment less the worker's secrets."""
    env = {k: v for k, v in os.environ.items() if k not in _NOT_FOR_RANKS}
    if url := settings.rank_nats_url or settings.nats_url:  # the rank credential when there is one
        env[RANK_NATS_URL_ENV] = url
    if settings.nats_tls_ca:  # the worker's setting, however it was given
        env[RANK_NATS_TLS_CA_ENV] = str(settings.nats_tls_ca)
    env.update(
        RANK=str(placement.rank),
        WORLD_SIZE=str(launch.world_size),
        LOCAL_RANK=str(placement.local_rank),
        LOCAL_WORLD_SIZE=str(local_world),
        MASTER_ADDR=launch.master_addr,
        MASTER_PORT=str(launch.master_port),
        VIGIL_NODE_NAME=settings.node_name,
        VIGIL_EXIT_FILE=str(exit_path),
        PYTHONUNBUFFERED="1",
    )
    if kind == "gpu":
        env["CUDA_VISIBLE_DEVICES"] = str(placement.device)
    else:
        env["DS_ACCELERATOR"] = "cpu"
        env["CUDA_VISIBLE_DEVICES"] = ""
        # share this node's cores among its slots instead of every rank claiming all of them
        env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // settings.cpu_slots)))
    return env
