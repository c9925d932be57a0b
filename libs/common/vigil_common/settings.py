"""Settings from `VIGIL_*` environment variables (and CLI flags), validated once.

Build them once at a program's start with `Settings.load()` and pass them down;
nothing reads the environment at import time.
"""

from __future__ import annotations

import re
import socket
from pathlib import Path
from typing import Any, Literal

from pydantic import Field, ValidationError, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from vigil.access import DEFAULT_DATA_DIR, DEFAULT_HTTP_HOST, DEFAULT_HTTP_PORT, MIN_TOKEN_LENGTH
from vigil.codepack import DEFAULT_MAX_MB as DEFAULT_CODE_MAX_MB
from vigil.errors import ConfigError

_NODE = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
# What a rank inherits from its worker's environment: nothing else (no credential, no VIGIL_* setting).
RANK_ENV_ALLOW = (
    "PATH", "HOME", "USER", "LOGNAME", "LANG", "LC_*", "TZ", "TMPDIR", "TERM",
    "PYTHONPATH", "PYTHONHASHSEED", "OMP_NUM_THREADS", "MKL_NUM_THREADS",
    "LD_LIBRARY_PATH", "CUDA_HOME", "CUDA_PATH", "NCCL_*", "ROCM_PATH", "HIP_PATH",
    "HF_HOME", "HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_DATASETS_OFFLINE", "TORCH_HOME",
    "TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR", "DS_ACCELERATOR", "DS_BUILD_OPS", "GLOO_SOCKET_IFNAME",
)  # fmt: skip


DEFAULT_JOB_UIDS = (60000, 60999)  # VIGIL_JOB_UIDS=auto on a root worker
MIN_JOB_UID, MAX_JOB_UID = 1000, 2**32 - 2  # no system user's uid; 2^32-1 is (uid_t)-1


def default_node_name() -> str:
    """The host name's first label, made safe as a subject token."""
    name = re.sub(r"[^A-Za-z0-9_-]", "-", socket.gethostname().split(".")[0])[:64]
    return name or "node"


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="VIGIL_", extra="ignore", frozen=True)

    nats_url: str | None = Field(None, description="NATS to use; unset: an embedded server")
    database_url: str | None = Field(None, description="Postgres to use; unset: an embedded server")
    data_dir: Path = Field(DEFAULT_DATA_DIR, description="embedded servers' data, checkpoints, logs")
    data_roots: list[Path] = Field(
        default_factory=list,
        description="folders a spec's data.path and data.tokenizer may name (JSON list); "
        "empty: <data dir>/datasets",
    )
    code_roots: list[Path] = Field(
        default_factory=list,
        description="folders a spec's entrypoint.workdir may name (JSON list); empty: <data dir>/code",
    )
    code_max_mb: float = Field(
        DEFAULT_CODE_MAX_MB,
        gt=0,
        le=10_000,
        description="largest code package (`vigil submit --code`): its files' bytes, in MB; set it alike "
        "on the scheduler (which refuses a larger upload) and the workers (which refuse to unpack one)",
    )
    workdir_overlay: bool = Field(
        True,
        description="a job run from a code root writes into an overlay of its folder (root and overlayfs); "
        "false: into a copy",
    )
    workdir_copy_max_mb: float = Field(
        1024,
        gt=0,
        description="largest code-root folder a worker copies for a job's writable working folder, in MB",
    )
    http_host: str = Field(DEFAULT_HTTP_HOST, description="the gateway's address")
    http_port: int = Field(DEFAULT_HTTP_PORT, ge=0, le=65535, description="the gateway's port")
    api_token: str | None = Field(None, min_length=MIN_TOKEN_LENGTH, description="the gateway's bearer token")
    users_file: Path | None = Field(
        None,
        description="users, teams, GPU quotas and token hashes (YAML or JSON), read at the scheduler's start",
    )
    console_session_s: int = Field(
        12 * 3600, ge=60, le=30 * 86_400, description="a console login lasts this long (seconds)"
    )
    node_name: str = Field(
        default_factory=default_node_name, description="a worker's name (default: the host name's 1st label)"
    )
    node_address: str | None = Field(
        None, description="where this node's ranks are reachable; unset: the address it reaches NATS from"
    )
    cpu_slots: int = Field(2, ge=1, le=1024, description="slots on a node without GPUs")
    warm_ranks: int | None = Field(
        None,
        ge=0,
        le=1024,
        description="built-in trainer processes a worker keeps started, imports done, for its next ranks; "
        "unset: one per device (enough for a job's ranks here); 0: none",
    )
    gpu_backend: Literal["auto", "nvml", "amdsmi", "cpu"] = Field(
        "auto", description="a worker's devices: auto (NVML, else amdsmi, else CPU slots) or one forced"
    )
    heartbeat_interval_s: float = Field(
        2.0, gt=0, le=300, description="a worker's heartbeat period (seconds); see VIGIL_NODE_LOST_AFTER"
    )
    node_lost_after: int = Field(3, ge=1, le=100, description="missed heartbeats before a node is lost")
    connect_timeout_s: float = Field(
        30.0,
        ge=0.5,
        le=3600,
        description="how long a service (a worker too) waits at its start for Postgres, then NATS, before "
        "it exits naming the one it cannot reach (they may start after it, as under compose)",
    )
    takeover_s: float = Field(
        10.0,
        ge=1,
        le=300,
        description="a standby scheduler takes over (the guardians a gone one's shares) within this long",
    )
    gpu_sample_interval_s: float = Field(
        5.0, gt=0, le=3600, description="device sampling period (NVML, amdsmi or CPU stats), seconds"
    )
    worker_end_ranks_on_stop: bool = Field(
        False, description="a stopping worker ends its ranks (vigil up); false: they train on for its restart"
    )
    max_attempts: int = Field(5, ge=1, le=1000, description="launch attempts before a job is FAILED")
    hot_spares: int = Field(
        0,
        ge=0,
        le=100_000,
        description="whole free nodes the scheduler holds in reserve (they run warm ranks and no job) for a "
        "running job that loses a node or a device: it takes one at once, ahead of the queue; 0: none",
    )
    preemptible_below_priority: int = Field(
        100,
        ge=-1001,
        le=1001,
        description="a job of lower priority whose spec leaves scheduling.preemptible unset may be preempted "
        "by a job of higher priority (it resumes from the step it stopped at); -1001: none by default",
    )
    time_limit_default_s: float | None = Field(
        None, ge=1, description="an attempt's time limit where the spec sets none; unset: no limit"
    )
    time_limit_max_s: float | None = Field(
        None, ge=1, description="the longest scheduling.time_limit a spec may ask for; unset: no maximum"
    )
    queue_policy: Literal["fair", "strict"] = Field(
        "fair",
        description="the placement pass's policy: fair (priority, fair share, EASY backfill, preemption) or "
        "strict (priority then submission order, a blocked head job holds up the queue, no preemption)",
    )
    fairshare_half_life_h: float = Field(
        168.0,
        gt=0,
        le=24 * 3650,
        description="half-life of a team's GPU-hours in its fair-share usage (Slurm's PriorityDecayHalfLife)",
    )
    transition_timeout_s: float = Field(
        300.0,
        ge=1,
        le=86_400,
        description="a job placed, halting or rolling back with no progress for this long is resolved by the"
        " scheduler (relaunched or ended, with an incident naming what was missing)",
    )
    max_body_bytes: int = Field(1024 * 1024, ge=1024, description="largest HTTP request body")
    sse_keepalive_s: float = Field(
        15.0, gt=0, le=300, description="an event stream quiet this long gets a keep-alive comment"
    )
    webhook_urls: list[str] = Field(default_factory=list, description="incident webhooks (JSON list)")
    console_url: str | None = Field(
        None,
        description="the console's address as people reach it, for the links in alerts; unset: "
        "http://VIGIL_HTTP_HOST:VIGIL_HTTP_PORT",
    )
    alert_attempts: int = Field(8, ge=1, le=100, description="attempts of an alert route's delivery")
    alert_backoff_s: float = Field(
        1.0, gt=0, le=3600, description="the wait after a failed alert delivery, doubled after each"
    )
    alert_max_backoff_s: float = Field(300.0, gt=0, le=86_400, description="the longest of those waits")
    alert_timeout_s: float = Field(10.0, gt=0, le=300, description="an alert delivery's HTTP timeout")
    stream_replicas: int = Field(
        1, ge=1, le=5, description="servers each JetStream stream is kept on (3 on a 3-server NATS cluster)"
    )
    metrics_port: int = Field(9464, ge=0, le=65535, description="telemetry's Prometheus /metrics; 0: off")
    nats_tls_ca: Path | None = Field(
        None, description="CA certificate that signed the NATS server's (with a tls:// URL)"
    )
    step_retention_days: float = Field(
        7.0, gt=0, le=3650, description="raw per-rank step rows kept this long; per-step aggregates forever"
    )
    step_partition_hours: int = Field(24, ge=1, le=24 * 31, description="one step partition per this period")
    peak_tflops: float | None = Field(
        None, gt=0, le=1e6, description="a device's peak TFLOP/s for MFU; unset: the table, or measured"
    )
    preempt_on_sigterm: bool = Field(
        False, description="SIGTERM to the worker is a preemption notice (spot nodes); false: a plain stop"
    )
    preemption_notice_file: Path | None = Field(
        None, description="a file whose appearance is a preemption notice (a cloud's, written by an agent)"
    )
    preemption_grace_s: float = Field(
        30.0, gt=0, le=3600, description="after a notice, how long ranks have to checkpoint before SIGKILL"
    )
    guardian_replay_s: float = Field(
        3600.0,
        ge=0,
        le=7 * 86_400,
        description="a new guardian judges the job events of this many seconds back (bounded replay)",
    )
    device_mark_ttl_s: float = Field(
        3600.0,
        gt=0,
        le=30 * 86_400,
        description="a device marked unhealthy by a job's replays is offered again after this long, "
        "unless the worker's diagnostic confirmed the mark",
    )
    device_marks_per_job: int = Field(
        2, ge=0, le=1024, description="devices one job's replays may mark unhealthy (unconfirmed marks)"
    )
    hang_stacks_s: float = Field(
        2.0,
        ge=0,
        le=60,
        description="on a hang, the guardian waits this long for the ranks' stacks, then acts; 0: no dump",
    )
    diagnose_timeout_s: float = Field(
        120.0, gt=0, le=3600, description="the worker's known-answer check of a device may run this long"
    )
    entrypoints: bool = Field(
        True,
        description="jobs may run their own program (a spec's entrypoint); false: the built-in trainer only",
    )
    job_uids: str = Field(
        "auto",
        description='the uids a worker runs jobs as, one per job ("60000-60999"); auto: that range when '
        "the worker is root, none otherwise; off: none (ranks run as the worker)",
    )
    shared_trust: bool = Field(
        False,
        description="a worker that cannot run each job as its own user still runs jobs' own programs "
        "(entrypoint): every job and the worker are then one trust domain",
    )
    rank_env_allow: list[str] = Field(
        default_factory=lambda: list(RANK_ENV_ALLOW),
        description="worker variables a rank inherits (names; a trailing * matches a prefix; JSON list)",
    )
    # --- ranks in Kubernetes pods (vigil_worker.rank_pod, .pod_table, .pod_relay) ---------------------------
    rank_runtime: Literal["process", "kubernetes"] = Field(
        "process",
        description="how a worker runs ranks: process (its children) or kubernetes (a pod per job per node)",
    )
    rank_namespace: str = Field(
        "vigil-jobs", pattern=r"^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?$", description="rank pods' namespace"
    )
    rank_image: str | None = Field(None, description="rank pods' image (kubernetes runtime; required there)")
    rank_checkpoint_claim: str = Field(
        "vigil-rank-checkpoints",
        description="the rank namespace's claim on the checkpoint storage (kubernetes runtime)",
    )
    rank_uid_base: int = Field(
        200_000,
        ge=1000,
        le=2**31 - 2**20,
        description="rank pods run as uid/gid base + a number from the job id",
    )
    rank_cpu: str = Field(
        "2", pattern=r"^[0-9]+(\.[0-9]+|m)?$", description="a rank pod container's CPU limit"
    )
    rank_memory: str = Field(
        "8Gi", pattern=r"^[0-9]+(Ki|Mi|Gi|Ti)?$", description="a rank pod container's memory limit"
    )
    relay_port: int = Field(
        7611,
        ge=1,
        le=65535,
        description="the worker's relay for rank pods (TCP on its pod IP; kubernetes runtime)",
    )
    k8s_api_url: str | None = Field(
        None, description="the Kubernetes API; unset: the in-cluster one (KUBERNETES_SERVICE_HOST)"
    )
    log_level: str = Field("INFO", description="the services' log level")
    trace_file: Path | None = Field(
        None, description="also write every span as a JSON line here (traces without a collector)"
    )

    @field_validator("node_name")
    @classmethod
    def _node_token(cls, value: str) -> str:
        if not _NODE.match(value):
            raise ValueError("use 1-64 letters, digits, '_' or '-' (it is a bus subject token)")
        return value

    @field_validator("job_uids")
    @classmethod
    def _uid_range(cls, value: str) -> str:
        if value in ("auto", "off"):
            return value
        first, sep, last = value.partition("-")
        if not sep or not first.strip().isdigit() or not last.strip().isdigit():
            raise ValueError(f"{value!r} is not auto, off or a range FIRST-LAST (60000-60999)")
        low, high = int(first), int(last)
        if not MIN_JOB_UID <= low <= high <= MAX_JOB_UID:
            raise ValueError(f"{value!r}: use uids from {MIN_JOB_UID} to {MAX_JOB_UID}, FIRST <= LAST")
        return f"{low}-{high}"

    @field_validator("nats_url")
    @classmethod
    def _nats_scheme(cls, value: str | None) -> str | None:
        if value is not None and not re.match(r"^(nats|tls|ws|wss)://", value):
            raise ValueError("must start with nats://, tls://, ws:// or wss://")
        return value

    @field_validator("database_url")
    @classmethod
    def _pg_scheme(cls, value: str | None) -> str | None:
        if value is not None and not re.match(r"^postgres(ql)?://", value):
            raise ValueError("must start with postgresql:// or postgres://")
        return value

    @field_validator("webhook_urls")
    @classmethod
    def _http_urls(cls, value: list[str]) -> list[str]:
        for url in value:
            if not re.match(r"^https?://", url):
                raise ValueError(f"{url!r} must start with http:// or https://")
        return value

    @field_validator("log_level")
    @classmethod
    def _level(cls, value: str) -> str:
        level = value.upper()
        if level not in ("DEBUG", "INFO", "WARNING", "ERROR"):
            raise ValueError("must be DEBUG, INFO, WARNING or ERROR")
        return level

    @classmethod
    def load(cls, **overrides: Any) -> Settings:
        """Settings from the environment, CLI flags overriding. Raises ConfigError naming the variable."""
        try:
            return cls(**{k: v for k, v in overrides.items() if v is not None})
        except ValidationError as exc:
            problems = "; ".join(
                f"VIGIL_{str(e['loc'][0]).upper()}: {e['msg'].removeprefix('Value error, ')}"
                for e in exc.errors(include_url=False)
            )
            raise ConfigError(f"invalid settings: {problems}") from exc

    @property
    def checkpoint_root(self) -> Path:
        return (self.data_dir / "checkpoints").resolve()

    @property
    def allowed_data_roots(self) -> list[Path]:
        """Where a job's data may be read from: by default a folder of its own in the data dir, never the
        data dir itself (which holds the credentials, the token and the token cache)."""
        return [p.resolve() for p in self.data_roots] or [(self.data_dir / "datasets").resolve()]

    @property
    def allowed_code_roots(self) -> list[Path]:
        """Where a job's own program may run: a folder of its own that holds no secret by default."""
        return [p.resolve() for p in self.code_roots] or [(self.data_dir / "code").resolve()]

    def job_uid_range(self, is_root: bool) -> range | None:
        """The uids jobs run as (VIGIL_JOB_UIDS), or None where ranks run as the worker's own user."""
        if self.job_uids == "off" or not is_root:
            return None
        low, high = DEFAULT_JOB_UIDS if self.job_uids == "auto" else map(int, self.job_uids.split("-"))
        return range(low, high + 1)

    @property
    def log_dir(self) -> Path:
        return (self.data_dir / "logs").resolve()

    @property
    def node_lost_after_s(self) -> float:
        return self.node_lost_after * self.heartbeat_interval_s
