"""How a LaunchJob becomes this node's rank processes: the run directory, each rank's argv, env and cwd.

A launch's run directory is `<data dir>/runs/<job>/attempt-<n>/`: the launch event as `launch.json`
(what the built-in trainer reads) and each rank's exit file. Logs go to `<log dir>/<job>/`.

A rank runs either the built-in GPT trainer (`python -m vigil_trainer`, the default) or the
job's own program (`entrypoint.argv`, in `entrypoint.workdir` under a code root, or inside the attempt's
copy of its code package, `code_pack`). Either way its
command line is an argument list that no shell sees, and its environment is built from scratch:
torchrun's variables (RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, NODE_RANK, MASTER_ADDR,
MASTER_PORT), what the SDK needs to reach this agent (`vigil.protocol`'s names, among them the
token is not there: it reaches the rank on an inherited pipe, `procs.RankTable.start`), the job's
`entrypoint.env`, and of the worker's own environment only the names in `VIGIL_RANK_ENV_ALLOW` (never a
credential: a rank holds no bus or database secret). A rank that runs as its job's own user
(`tenancy`) gets that user's HOME (a folder of its job's), USER and LOGNAME.

Where this node's address (`VIGIL_NODE_ADDRESS`, what the worker advertises and rank 0's node offers as
MASTER_ADDR) is an interface's IPv4 address, GLOO_SOCKET_IFNAME names that interface unless the job or the
worker's environment already does: gloo's ranks then listen where the other nodes reach this one. Left to
itself gloo takes the address the host name resolves to, on Debian's default /etc/hosts 127.0.1.1, which
no other node reaches (every cross-node connection is refused and the job fails).
"""

from __future__ import annotations

import fcntl
import fnmatch
import hashlib
import ipaddress
import json
import os
import secrets
import socket
import struct
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from vigil import protocol as proto
from vigil.errors import SpecError
from vigil.events import LaunchJob, RankPlacement
from vigil.handover import PARK_ENV
from vigil.paths import OutsideRoots, within
from vigil_common.settings import Settings
from vigil_worker.code_pack import code_dir
from vigil_worker.tenancy import JobUser, job_dir, snapshot_dir

PYTHON_NAMES = ("python", "python3")  # an entrypoint's argv[0] that means the worker's own interpreter
GLOO_IFNAME = "GLOO_SOCKET_IFNAME"
_SIOCGIFADDR = 0x8915  # Linux: an interface's (first) IPv4 address

TRAINER_MODULE = "vigil_trainer"  # the built-in trainer: `python -m TRAINER_MODULE`


@dataclass(frozen=True)
class RankLaunch:
    """One rank of a launch, ready to start."""

    placement: RankPlacement
    argv: list[str]
    env: dict[str, str]
    cwd: Path | None
    token: str  # the rank's proof of identity to this agent (on an inherited pipe, never in its env)
    log_path: Path
    exit_path: Path


def prepare_ranks(
    launch: LaunchJob, settings: Settings, kind: str, socket_path: Path, user: JobUser | None = None
) -> list[RankLaunch]:
    """This node's ranks of `launch` (none if it places nothing here), its run directory written.

    `kind` is this node's device kind ("gpu" or "cpu"); `socket_path` where this agent's relay listens;
    `user` the job's own user here (None: the ranks run as the worker). SpecError (naming the field)
    when the job's program may not run here."""
    mine = [p for p in launch.placement if p.node == settings.node_name]
    if not mine:
        return []
    # a job runs as a user of its own here, or in a pod of its own (its own uid: `rank_pod`)
    argv, cwd = program(launch, settings, isolated=user is not None or settings.rank_runtime == "kubernetes")
    job = str(launch.job_id)
    run_dir = job_dir(settings, job) / f"attempt-{launch.attempt}"
    run_dir.mkdir(parents=True, exist_ok=True)
    launch_file = run_dir / "launch.json"
    launch_file.write_bytes(launch.to_bytes())
    if argv is None:
        cache = job_dir(settings, job) / "cache" if user is not None else None  # never another job's
        argv = trainer_argv(launch_file, settings, cache)
    ranks = []
    for p in mine:
        exit_path = run_dir / f"rank-{p.rank}.exit"
        token = secrets.token_urlsafe(32)
        ranks.append(
            RankLaunch(
                placement=p,
                argv=argv,
                env=rank_env(launch, p, len(mine), kind, settings, exit_path, socket_path, user),
                cwd=cwd,
                token=token,
                log_path=settings.log_dir / job / f"attempt-{launch.attempt}-rank-{p.rank}.log",
                exit_path=exit_path,
            )
        )
    return ranks


def agent_socket(settings: Settings) -> Path:
    """Where this node's agent listens for its ranks: in the data dir's `sockets` folder (apart from the
    worker's state, which no rank may enter), or, where that path is too long for a Unix socket (108
    bytes), in a folder of its own under the system's temporary one."""
    path = settings.data_dir.resolve() / "sockets" / f"{settings.node_name}.sock"
    if len(str(path).encode()) <= 100:
        return path
    digest = hashlib.sha256(str(path).encode()).hexdigest()[:16]
    return Path(tempfile.gettempdir()) / f"vigil-agent-{digest}" / "agent.sock"


def program(
    launch: LaunchJob, settings: Settings, *, isolated: bool = True
) -> tuple[list[str] | None, Path | None]:
    """The job's own argv and working folder; (None, None) for the built-in trainer. `isolated`: the job
    runs as its own user here; where it would run as the worker, its own program runs only with
    VIGIL_SHARED_TRUST."""
    entry = launch.spec.entrypoint
    if entry is None:
        return None, None
    if not settings.entrypoints:
        raise SpecError([{"field": "entrypoint", "message": "this cluster runs the built-in trainer only "
                          "(VIGIL_ENTRYPOINTS=false)"}])  # fmt: skip
    if not isolated and not settings.shared_trust:
        raise SpecError([{"field": "entrypoint", "message": "this worker cannot run a job as a user of its "
                          "own (it is not root, or VIGIL_JOB_UIDS=off), so it runs no job's own program; "
                          "VIGIL_SHARED_TRUST=true runs them as the worker's user, every job and the worker "
                          "one trust domain"}])  # fmt: skip
    if entry.code is not None:  # unpacked by the agent before (`code_pack`): the attempt's own copy
        if settings.rank_runtime != "process":
            message = "code packages run on the process runtime only (VIGIL_RANK_RUNTIME=process)"
            raise SpecError([{"field": "entrypoint.code", "message": message}])
        roots = [code_dir(settings, str(launch.job_id), launch.attempt)]
        setting = "the code package"
    else:
        roots, setting = settings.allowed_code_roots, "VIGIL_CODE_ROOTS"
    try:
        cwd = within(entry.workdir or ".", roots, setting=setting)
    except OutsideRoots as exc:
        raise SpecError([{"field": "entrypoint.workdir", "message": str(exc)}]) from exc
    if not cwd.is_dir():
        raise SpecError([{"field": "entrypoint.workdir", "message": f"{cwd} is not a folder on this node"}])
    argv = list(entry.argv)
    if argv[0] in PYTHON_NAMES:
        argv[0] = sys.executable  # the worker's Python, where the `vigil` SDK is installed
    return argv, cwd


def trainer_argv(launch_file: Path, settings: Settings, cache: Path | None = None) -> list[str]:
    """The built-in trainer's command line: every value from Vigil, none from a shell, none secret.
    `cache`: its tokenized data cache (default: the data dir's, shared by the jobs of one trust domain)."""
    argv = [
        sys.executable, "-m", TRAINER_MODULE,
        "--launch", str(launch_file),
        "--checkpoint-root", str(settings.checkpoint_root),
        "--cache-dir", str(cache or (settings.data_dir / "cache").resolve()),
        "--node", settings.node_name,
    ]  # fmt: skip
    for root in settings.allowed_data_roots:
        argv += ["--data-root", str(root)]
    if settings.peak_tflops is not None:
        argv += ["--peak-tflops", repr(settings.peak_tflops)]
    return argv


def inherited(settings: Settings, environ: dict[str, str] | None = None) -> dict[str, str]:
    """The worker's variables a rank may see: only the allowlisted names (`VIGIL_RANK_ENV_ALLOW`)."""
    source = os.environ if environ is None else environ
    allow = settings.rank_env_allow
    return {k: v for k, v in source.items() if any(fnmatch.fnmatchcase(k, pattern) for pattern in allow)}


def rank_env(
    launch: LaunchJob,
    placement: RankPlacement,
    local_world: int,
    kind: str,
    settings: Settings,
    exit_path: Path,
    socket_path: Path,
    user: JobUser | None = None,
) -> dict[str, str]:
    """One rank's whole environment (see the module's docstring)."""
    env = inherited(settings)
    if user is not None:  # the worker's HOME and name are not the job's
        home = job_dir(settings, str(launch.job_id)) / "home"
        env.update(HOME=str(home), USER=user.name, LOGNAME=user.name)
        # torch.compile's caches hold code that runs: the job's own (kept across its attempts), never a
        # folder shared with other jobs (whose user may not write it, or could plant code in it)
        env.update(
            TORCHINDUCTOR_CACHE_DIR=str(home / ".cache" / "torchinductor"),
            TRITON_CACHE_DIR=str(home / ".cache" / "triton"),
        )
        # its temporary files in its own folder, not the node's /tmp: a uid goes to another job later, and
        # what a job left under /tmp/torchinductor_<user> (precompiled headers, 147 MB) the next job of
        # that uid would use; removed when the job has no rank here (`Tenancy.release`)
        env["TMPDIR"] = str(home.parent / "tmp")
    if launch.spec.entrypoint is not None:
        env.update(launch.spec.entrypoint.env)
    nodes = list(dict.fromkeys(p.node for p in sorted(launch.placement, key=lambda p: p.rank)))
    if GLOO_IFNAME not in env and settings.node_address and (ifname := interface_of(settings.node_address)):
        env[GLOO_IFNAME] = ifname
    env.update(
        RANK=str(placement.rank),
        WORLD_SIZE=str(launch.world_size),
        LOCAL_RANK=str(placement.local_rank),
        LOCAL_WORLD_SIZE=str(local_world),
        NODE_RANK=str(nodes.index(placement.node)),
        MASTER_ADDR=launch.master_addr,
        MASTER_PORT=str(launch.master_port),
        PYTHONUNBUFFERED="1",
    )
    env[proto.JOB_ID_ENV] = str(launch.job_id)
    env[proto.ATTEMPT_ENV] = str(launch.attempt)
    env[proto.NODE_ENV] = settings.node_name
    env[proto.AGENT_SOCKET_ENV] = str(socket_path)
    env[proto.EXIT_FILE_ENV] = str(exit_path)
    if launch.spec.entrypoint is None and settings.rank_runtime == "process":
        env[PARK_ENV] = "1"  # a failed collective: it waits for the next attempt in its process (`park`)
    env[proto.CHECKPOINT_ROOT_ENV] = str(settings.checkpoint_root)
    env[proto.CHECKPOINT_KEEP_ENV] = str(launch.spec.checkpoint.keep)
    if (snapshots := snapshot_dir(settings, str(launch.job_id))) is not None:
        env[proto.SNAPSHOT_DIR_ENV] = str(snapshots)
    env[proto.JOB_SPEC_ENV] = launch.spec.model_dump_json(exclude={"entrypoint": {"env"}})
    if launch.resume_from:
        env[proto.RESUME_FROM_ENV] = launch.resume_from
    if launch.skip_data:
        env[proto.SKIP_DATA_ENV] = f"{launch.skip_data[0]}:{launch.skip_data[1]}"
    if kind == "gpu":
        env["CUDA_VISIBLE_DEVICES"] = str(placement.device)
    else:
        env["DS_ACCELERATOR"] = "cpu"
        env["CUDA_VISIBLE_DEVICES"] = ""
        # share this node's cores among its slots instead of every rank claiming all of them
        env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // settings.cpu_slots)))
    return env


def warm_argv(argv: list[str]) -> list[str] | None:
    """The built-in trainer's arguments in a rank's command line (what a warm rank runs), or None for a
    job's own program (never run by a warm rank: its imports are its own)."""
    head = [sys.executable, "-m", TRAINER_MODULE]
    return argv[len(head) :] if argv[: len(head)] == head else None


def handed_launch(
    rank: RankLaunch, uid: int | None = None, gid: int | None = None, procs: list[bytes] | None = None
) -> bytes:
    """What a waiting built-in trainer process is handed to become `rank` (`vigil.handover.Launch`, one
    JSON line): a warm rank (its user and cgroup to join) or a parked one (already both)."""
    argv = warm_argv(rank.argv)
    assert argv is not None, "only the built-in trainer waits to be handed a rank"
    launch = {
        "argv": argv,
        "env": rank.env,
        "cwd": str(rank.cwd) if rank.cwd else None,
        "log": str(rank.log_path),
        "token": rank.token,
        "uid": uid,
        "gid": gid,
        "cgroup": [os.fsdecode(p) for p in procs or []],
    }
    return json.dumps(launch).encode() + b"\n"


def standby_env(settings: Settings, kind: str, device: int | None) -> dict[str, str]:
    """A warm rank's environment before its launch: the node's part of `rank_env` only (no job's
    variable, no secret), so that its imports see what the rank's will (DeepSpeed's accelerator, the
    threads, a GPU's visibility: the device it waits for)."""
    env = inherited(settings)
    env["PYTHONUNBUFFERED"] = "1"
    if kind == "gpu":
        env["CUDA_VISIBLE_DEVICES"] = str(device)
        env["PYTORCH_NVML_BASED_CUDA_CHECK"] = "1"  # is_available() without initialising CUDA
    else:
        env["DS_ACCELERATOR"] = "cpu"
        env["CUDA_VISIBLE_DEVICES"] = ""
        env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // settings.cpu_slots)))
    return env


def interface_of(address: str) -> str | None:
    """The network interface whose IPv4 address `address` is; None for a loopback or unspecified address,
    a host name or IPv6 address, one no interface has, or where interfaces cannot be asked (not Linux)."""
    try:
        ip = ipaddress.IPv4Address(address)
    except ValueError:
        return None
    if ip.is_loopback or ip.is_unspecified:
        return None
    try:
        names = [name for _, name in socket.if_nameindex()]
    except OSError:
        return None
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        for name in names:
            try:
                answer = fcntl.ioctl(probe.fileno(), _SIOCGIFADDR, struct.pack("256s", name.encode()[:15]))
            except OSError:  # no IPv4 address, or not Linux
                continue
            if socket.inet_ntoa(answer[20:24]) == str(ip):
                return name
    return None
