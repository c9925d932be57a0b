"""The HTTP API's answers, as pydantic models: what the gateway returns and what `vigil.Client` reads.

One definition for both sides: the gateway builds its answers with these (so a row's other columns
never reach a client), and `vigil.Client` reads them back (a field a newer server adds is ignored).
"""

from __future__ import annotations

from datetime import datetime
from typing import Annotated, Any

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field

from vigil.spec_base import not_a_bool, only_a_bool


class Out(BaseModel):
    model_config = ConfigDict(extra="ignore", frozen=True)


class RankOut(Out):
    rank: int
    node: str
    device: int
    local_rank: int


class JobOut(Out):
    id: str
    name: str
    state: str
    priority: int
    attempt: int
    placement: list[RankOut]
    master_addr: str | None = None
    master_port: int | None = None
    resume_from: str | None = None
    last_step: int | None = None
    loss: float | None = None
    mfu: float | None = None  # the newest step's model FLOPs utilisation (of one rank)
    tokens_per_s: float | None = None  # the newest step's tokens/s (of one rank)
    reason: str | None = None
    created_at: datetime
    updated_at: datetime
    finished_at: datetime | None = None
    spec: dict[str, Any]
    owner: str = "admin"  # who submitted it; it, its team and admins see it
    team: str | None = None
    queue_reason: str | None = None  # why a queued job waits, when not for devices (a quota)


class TransitionOut(Out):
    attempt: int
    from_state: str | None
    to_state: str
    cause: str
    occurred_at: datetime


class RankStatusOut(Out):
    rank: int
    node: str
    started_at: datetime | None
    exited_at: datetime | None
    exit_code: int | None
    failure: str | None


class AttemptOut(Out):
    attempt: int
    launched_at: datetime
    placement: list[RankOut]
    # its ranks: fewer than the spec's nodes x gpus_per_node where an elastic job continued on fewer nodes
    world_size: int | None = None  # None: from a server before it was reported
    resume_from: str | None
    ended: str | None  # the cause that ended it; None while it runs
    code: str | None = None  # the SHA-256 of the code package it ran (`entrypoint.code`); None: none


class QueueEntryOut(Out):
    """A queued job's place in the queue (`GET /api/v1/queue`, and a queued job's detail)."""

    id: str
    name: str
    owner: str = "admin"
    team: str | None = None
    priority: int
    gpus: int  # the devices it asks for
    position: int  # 1: the next to be placed, in the whole queue
    reason: str  # why it waits, in words
    estimated_start: datetime | None = None  # from the running jobs' time limits; None: unknown
    reserved: bool = False  # the blocked head: devices are reserved for it from `estimated_start`
    starting: bool = False  # it waits for nothing: the next placement pass places it
    created_at: datetime


class TeamStandingOut(Out):
    """A team's place in the fair share: its share and usage, each normalised over the teams taking part."""

    team: str | None  # None: users without a team
    share: float
    usage: float
    gpu_hours: float  # decayed by VIGIL_FAIRSHARE_HALF_LIFE_H
    ratio: float  # usage / share: over 1 is over its share
    factor: float  # Slurm's fair-share factor, 2^(-usage/share): orders jobs of equal priority


class QueueOut(Out):
    items: list[QueueEntryOut]  # in queue order
    next: str | None = None  # the queue is one page
    teams: list[TeamStandingOut] = []
    as_of: datetime


class JobDetailOut(JobOut):
    transitions: list[TransitionOut]
    attempts: list[AttemptOut]
    ranks: list[RankStatusOut]  # of the current attempt
    queue: QueueEntryOut | None = None  # a queued job's position, why it waits and its estimated start


class JobPage(Out):
    items: list[JobOut]
    next: str | None


class DeviceOut(Out):
    node: str
    index: int
    kind: str
    name: str
    uuid: str
    memory_bytes: int
    nvlink_peers: list[int]
    healthy: bool
    unhealthy_reason: str | None
    mark_source: str | None = None  # gpu_health, replay or diagnostic (an active mark's)
    mark_expires_at: datetime | None = None  # a replay's mark lapses then; None: until cleared
    reported_free: bool
    present: bool
    job_id: str | None
    rank: int | None


class NodeOut(Out):
    name: str
    address: str
    alive: bool
    last_heartbeat: datetime
    started_at: datetime
    interval_s: float
    lost_at: datetime | None
    devices: list[DeviceOut]
    spare: bool = False  # held in reserve for a job that loses a node (VIGIL_HOT_SPARES)


class NodePage(Out):
    items: list[NodeOut]
    next: str | None


class GpuOut(DeviceOut):
    alive: bool
    latest: dict[str, Any] | None


class DeviceMarkCleared(Out):
    """An operator's clearing of a device's unhealthy mark: the mark that was removed."""

    node: str
    index: int
    cleared: dict[str, Any]


class GpuPage(Out):
    items: list[GpuOut]
    next: str | None


class Page(Out):
    """A page of telemetry rows (steps, checkpoints, incidents) as the read model returns them."""

    items: list[dict[str, Any]]
    next: str | None


class FieldErrorOut(Out):
    field: str
    message: str


class ErrorOut(Out):
    """Every error: `gateway.errors` makes this body for every status."""

    status: int
    error: str
    message: str
    fields: list[FieldErrorOut]


class HolderOut(Out):
    role: str  # "scheduler" or "guardian"
    instance: str  # pid@host of the process
    address: str | None
    since: datetime
    shares: list[int] = Field(default_factory=list)  # a guardian's shares of the jobs (of SHARES)


class ControlPlaneOut(Out):
    """The active scheduler (a standby is not listed) and every live guardian with the shares it judges."""

    active: list[HolderOut]


class Health(Out):
    status: str
    checks: dict[str, str] = {}
    role: str | None = None  # a scheduler's: "active" (holds the scheduling lock) or "standby"


class PrincipalOut(Out):
    """Who a token stands for (`GET /api/v1/me`)."""

    name: str
    team: str | None = None
    admin: bool = False
    actor: str  # how the audit record names it


# a GPU quota: `false` is not 0 GPUs
GpuCount = Annotated[int, Field(ge=0, le=1_000_000), BeforeValidator(not_a_bool)]


class UserIn(BaseModel):
    """`PUT /api/v1/users/{name}`: the user's team, admin flag and GPU quota (none: no limit)."""

    model_config = ConfigDict(extra="forbid")

    team: str | None = Field(None, pattern=r"^[a-z0-9][a-z0-9._-]{0,62}$")
    admin: Annotated[bool, BeforeValidator(only_a_bool)] = False
    gpus: GpuCount | None = Field(None, description="devices its jobs hold at once")


class UserOut(Out):
    name: str
    team: str | None = None
    admin: bool = False
    gpus: int | None = None
    source: str = "api"  # "file": from VIGIL_USERS_FILE
    tokens: int | None = None  # live tokens (in a listing)


class UserList(Out):
    items: list[UserOut]


class TokenOut(Out):
    """A new token: shown this once, only its SHA-256 is kept."""

    user: str
    token: str


class RevokedOut(Out):
    user: str
    revoked: int


class TeamIn(BaseModel):
    model_config = ConfigDict(extra="forbid")

    gpus: GpuCount | None = Field(None, description="devices the team's jobs hold at once")


class TeamShareIn(BaseModel):
    """`PUT /api/v1/teams/{name}/share`: the team's weight in the fair share."""

    model_config = ConfigDict(extra="forbid")

    share: float = Field(
        gt=0, le=1_000_000, allow_inf_nan=False, description="the team's weight in the fair share (default 1)"
    )


class TeamOut(Out):
    name: str
    gpus: int | None = None
    share: float = 1.0  # its weight in the fair share
    source: str = "api"


class TeamList(Out):
    items: list[TeamOut]
