"""The wire protocol: every event and command that crosses the bus, versioned.

Events are facts in the past tense (`StepCompleted`, `GpuSampled`, `RankExited`);
commands are imperative (`LaunchJob`, `HaltJob`, `RollbackJob`). All share one
envelope: `event_id` (in the `Nats-Msg-Id`, with the subject), `type`, `schema_version`, `occurred_at`
(UTC), `job_id` and `attempt`.

A breaking change is a new class with a higher `schema_version` registered beside
the old one, never an edit in place. Golden JSON per version lives in
`tests/unit/common/golden/`.
"""

from __future__ import annotations

import contextlib
import functools
import json
import re
import uuid
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Annotated, Any, ClassVar, Literal, TypeGuard, TypeVar, get_args

from pydantic import (
    AwareDatetime,
    BaseModel,
    ConfigDict,
    Field,
    StringConstraints,
    ValidationError,
    field_validator,
)

from vigil.errors import MalformedMessage
from vigil.jobstates import TERMINAL_STATES as TERMINAL_STATES  # re-exported for older importers
from vigil.jobstates import JobState
from vigil.spec import GuardianSpec, JobSpec

IncidentKind = Literal[
    "nan",
    "spike",
    "divergence",
    "imbalance",
    "straggler",
    "hang",
    "gpu_health",
    "rank_exit",
    "node_lost",
    "oom",
    "sdc",
    "report_refused",
    "lifecycle",  # the scheduler's: a halt or rollback its ranks outran, a transition that timed out
    "preemption",  # the scheduler's: a job of higher priority preempted this one (`PreemptJob`)
    "time_limit",  # the scheduler's: an attempt ran past its scheduling.time_limit (`PreemptJob`)
]
# What an incident did: a spec action, or the ranks' own recovery of a held step ("replay": the replay
# was clean, a transient fault; "skip": the data reproduced it and its window was skipped). A spec's
# `rollback` is done in place ("rollback": `RollbackJob`) or by relaunching the ranks from the checkpoint
# ("restart": `RestartJob`; IncidentRaised v2, a v1 incident said "rollback" for both).
IncidentAction = Literal["alert", "halt", "rollback", "restart", "fail", "replay", "skip"]
IncidentActionV1 = Literal["alert", "halt", "rollback", "fail", "replay", "skip"]
# What the replay of a held step showed (`StepReplayed`).
ReplayOutcome = Literal["transient", "reproduced"]
DeviceKind = Literal["gpu", "cpu"]
# Why a checkpoint did not load (`CheckpointRefused`): it failed its manifest, or verified and raised.
CheckpointRefusal = Literal["hash", "load"]
# Why a rank ended, in the spirit of determined's FailureType.
# "preempted": the rank wrote the emergency checkpoint on a preemption notice and exited (not a failure
# of the job: its next attempt does not count against VIGIL_MAX_ATTEMPTS).
# "spec": the job's spec cannot run (a path outside its roots, entrypoints off, ...): the job FAILS at
# once, as another attempt would fail the same way.
FailureType = Literal["ok", "error", "signal", "oom", "killed_by_vigil", "lost", "preempted", "spec"]


# --- bounds ----------------------------------------------------------------------------------------------
# What a rank reports is bounded field by field (issue 31): integers fit the Postgres column that stores
# them (steps and data positions are int8, migration 0014; ranks and attempts int4), strings have a
# length and no NUL (Postgres text holds none), lists a length. The worker's relay refuses, field by
# field, what does not fit (`vigil_worker.relay`). Tightening a bound that only refuses absurd input
# is not a breaking change (no version bump): every message a real sender made still decodes.

MAX_INT4 = 2**31 - 1
MAX_INT8 = 2**63 - 1
MAX_RANKS = 1 << 20  # a rank index is below this (and below the job's world size, checked by the relay)
MAX_CULPRITS = 1024  # ranks named by one StepReplayed (the trainer names the first ones)
MAX_EVIDENCE_BYTES = 4096  # a rank's evidence, serialized as JSON
_NO_NUL = r"^[^\x00]*$"

Step = Annotated[int, Field(ge=0, le=MAX_INT8)]  # steps and data positions (int8 columns)
Count = Annotated[int, Field(ge=0, le=MAX_INT8)]  # bytes, tokens (int8 columns)
Rank = Annotated[int, Field(ge=0, lt=MAX_RANKS)]
Int4 = Annotated[int, Field(ge=0, le=MAX_INT4)]
Name = Annotated[str, StringConstraints(max_length=256, pattern=_NO_NUL)]  # node, ids, digests
Text = Annotated[str, StringConstraints(max_length=4096, pattern=_NO_NUL)]  # paths, messages
LogTail = Annotated[str, StringConstraints(max_length=16384, pattern=_NO_NUL)]
DataWindow = tuple[Step, Step]


def evidence_size(evidence: dict[str, Any]) -> int:
    """The evidence's size as JSON (non-finite numbers as NaN / Infinity, other values as text)."""
    return len(json.dumps(evidence, separators=(",", ":"), default=str).encode())


def utcnow() -> datetime:
    return datetime.now(UTC)


def new_id() -> str:
    return uuid.uuid4().hex


class Message(BaseModel):
    """The envelope every event and command shares."""

    model_config = ConfigDict(extra="forbid", frozen=True, ser_json_inf_nan="strings")

    role: ClassVar[Literal["event", "command"]] = "event"

    event_id: str = Field(default_factory=new_id, min_length=1, max_length=128)
    type: str
    schema_version: int
    occurred_at: AwareDatetime = Field(default_factory=utcnow)
    job_id: str | None = Field(None, pattern=r"^[A-Za-z0-9_-]{1,64}$")
    attempt: int = Field(0, ge=0, le=MAX_INT4)

    def to_bytes(self) -> bytes:
        return self.model_dump_json().encode()

    def upgraded(self) -> Message:
        """This message as its current version; an older version that is still read overrides it."""
        return self


class Command(Message):
    role: ClassVar[Literal["event", "command"]] = "command"


# --- node -------------------------------------------------------------------------------------------


class Device(BaseModel):
    """One schedulable slot on a node: a GPU, or a CPU slot on a node without GPUs."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    index: int = Field(ge=0)
    kind: DeviceKind
    name: str
    uuid: str
    memory_bytes: int = Field(0, ge=0)
    nvlink_peers: list[int] = Field(default_factory=list, description="indices joined to this one by NVLink")
    healthy: bool = True


class NodeHeartbeat(Message):
    type: Literal["node.heartbeat"] = "node.heartbeat"
    schema_version: Literal[1] = 1
    node: str
    address: str = Field(description="the address ranks on this node are reachable at (rendezvous)")
    devices: list[Device]
    free: list[int] = Field(description="indices of devices not running a rank")
    interval_s: float = Field(gt=0, description="the worker's heartbeat period")
    started_at: AwareDatetime


class GpuSampled(Message):
    """One NVML sample of one device (or a CPU slot's process stats)."""

    type: Literal["gpu.sampled"] = "gpu.sampled"
    schema_version: Literal[1] = 1
    node: str
    index: int = Field(ge=0)
    device_kind: DeviceKind
    uuid: str
    utilization_pct: float | None = None
    memory_used_bytes: int | None = None
    memory_total_bytes: int | None = None
    temperature_c: float | None = None
    power_w: float | None = None
    sm_clock_mhz: int | None = None
    mem_clock_mhz: int | None = None
    throttle_reasons: list[str] = Field(default_factory=list)
    ecc_corrected: int | None = None
    ecc_uncorrected: int | None = None
    xid: int | None = None


# --- job: launch ---------------------------------------------------------------------------------------


class RankPlacement(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    rank: int = Field(ge=0)
    node: str
    device: int = Field(ge=0, description="device index on the node")
    local_rank: int = Field(ge=0)


class LaunchJob(Command):
    type: Literal["job.launch"] = "job.launch"
    schema_version: Literal[1] = 1
    spec: JobSpec
    placement: list[RankPlacement]
    master_addr: str
    master_port: int = Field(ge=1, le=65535)
    resume_from: str | None = Field(None, description="checkpoint directory to resume from")
    skip_data: DataWindow | None = Field(None, description="[start, end) steps whose data is skipped")

    @property
    def world_size(self) -> int:
        return len(self.placement)


# --- job: steps ----------------------------------------------------------------------------------------


class _StepFields(Message):
    """What every version of StepCompleted carries (a released version's golden file pins its own)."""

    type: Literal["step.completed"] = "step.completed"
    rank: Rank
    node: Name
    step: Step
    loss: float
    grad_norm: float | None = Field(None, description="the global gradient norm, after the all-reduce")
    lr: float
    tokens: Count = Field(description="tokens this rank processed in this step")
    tokens_per_s: float
    data_time_s: float = 0.0
    forward_time_s: float = 0.0
    backward_time_s: float = 0.0
    comm_time_s: float = 0.0
    optimizer_time_s: float = 0.0
    step_time_s: float
    mem_allocated_bytes: Count | None = None
    mem_peak_bytes: Count | None = None
    skipped: bool = Field(False, description="the update was not applied (non-finite gradients)")
    data_position: Step = Field(0, description="the data step this step's batch came from")


class StepCompletedV1(_StepFields):
    """Version 1 of StepCompleted, still read: `decode` upgrades it to the current version."""

    schema_version: Literal[1] = 1

    def upgraded(self) -> StepCompleted:
        # A v1 sender did not say whether its own numbers were finite before the all-reduce: unknown.
        return StepCompletedV2(**self.model_dump(exclude={"schema_version"}), local_finite=None).upgraded()


class _StepFieldsV2(_StepFields):
    """What version 2 added, and version 3 keeps."""

    local_finite: bool | None = Field(
        description="this rank's own loss was finite before the all-reduce; None: not known (a v1 sender)"
    )
    flops_per_token: float | None = Field(None, ge=0, description="model FLOPs per token (6N + attention)")
    mfu: float | None = Field(None, ge=0, description="model FLOPs utilisation against the device's peak")
    micro_batch: int | None = Field(
        None,
        ge=1,
        le=MAX_INT4,
        description="the micro-batch this step ran with (half the spec's after an out-of-memory)",
    )


class StepCompletedV2(_StepFieldsV2):
    """Version 2 of StepCompleted, still read: `decode` upgrades it to the current version.

    Version 2 added what only the rank itself knows: whether its own loss was finite before the
    all-reduce (after it every rank's grad norm is NaN, so this names the rank that made a NaN), and
    the model FLOPs behind its throughput.
    """

    schema_version: Literal[2] = 2

    def upgraded(self) -> StepCompleted:
        # A v2 sender did not number its in-place rollbacks: its steps are read as the attempt's first run.
        return StepCompleted(**self.model_dump(exclude={"schema_version"}), generation=0)


class StepCompleted(_StepFieldsV2):
    """One rank finished one optimizer step. Times are measured, in seconds.

    Version 3 adds `generation`: which run of its steps within the attempt this is. A step re-run after
    an in-place rollback keeps its (attempt, rank, step) but not its generation, so the abandoned run
    and the re-run are two histories (the aggregate keeps the highest generation's).
    """

    schema_version: Literal[3] = 3
    generation: Int4 = Field(
        0, description="in-place rollbacks this rank did in this attempt before this step: 0 on a first run"
    )


# --- job: status ---------------------------------------------------------------------------------------


class RankStarted(Message):
    type: Literal["rank.started"] = "rank.started"
    schema_version: Literal[1] = 1
    rank: Rank
    node: Name
    pid: int = Field(ge=0, le=MAX_INT4)
    log_path: Text


class RankExited(Message):
    type: Literal["rank.exited"] = "rank.exited"
    schema_version: Literal[1] = 1
    rank: Rank
    node: Name
    exit_code: int | None = Field(
        ge=-MAX_INT4, le=MAX_INT4, description="the process exit code; None when killed by a signal"
    )
    signal: int | None = Field(None, ge=0, le=255)
    failure: FailureType
    last_step: Step | None = None
    log_tail: LogTail = ""


class CheckpointSaved(Message):
    type: Literal["checkpoint.saved"] = "checkpoint.saved"
    schema_version: Literal[1] = 1
    step: Step
    path: Text
    bytes: Count
    manifest_sha256: Name
    data_position: Step


class RanksHalted(Message):
    """Every rank of the job stopped at the same step boundary."""

    type: Literal["ranks.halted"] = "ranks.halted"
    schema_version: Literal[1] = 1
    step: Step
    command_id: Name
    node: Name


class RollbackCompleted(Message):
    type: Literal["rollback.completed"] = "rollback.completed"
    schema_version: Literal[1] = 1
    from_step: Step
    to_step: Step
    checkpoint: Text
    skip_data: DataWindow | None = None
    command_id: Name
    duration_s: float = Field(ge=0)
    node: Name


class RestartRequested(Message):
    """The ranks were told to roll back in place but their program registered no way to load a
    checkpoint in place: they stop, and ask for a relaunch from `checkpoint` (the scheduler starts the
    next attempt with it as `resume_from`, as for a RestartJob)."""

    type: Literal["restart.requested"] = "restart.requested"
    schema_version: Literal[1] = 1
    checkpoint: Text
    step: Step = Field(description="the checkpoint's step")
    skip_data: DataWindow | None = None
    command_id: Name
    node: Name


class OutOfMemoryHalted(Message):
    """A step ran out of memory on `rank` and the retry with half the micro-batch did too: every rank
    wrote the emergency checkpoint of `checkpoint_step` and halted. The guardian records it as an `oom`
    incident (ranks publish no incident themselves)."""

    type: Literal["ranks.out_of_memory"] = "ranks.out_of_memory"
    schema_version: Literal[1] = 1
    step: Step
    rank: Rank
    node: Name
    micro_batch: int = Field(ge=1, le=MAX_INT4)
    grad_accum: int = Field(ge=1, le=MAX_INT4)
    checkpoint_step: Step
    message: Text


class RankValue(BaseModel):
    """One rank's number at a held step: its first execution's and its replay's."""

    model_config = ConfigDict(extra="forbid")
    rank: Rank
    first: float | None = Field(description="the first execution's loss (null: not finite)")
    replay: float | None = Field(description="the replay's loss (null: not finite)")


class StepReplayed(Message):
    """The ranks held a step they judged bad at the step boundary (`kind`: a non-finite loss or a spike of
    the spec's rule), did not apply it, and ran it again in place from the same parameters and data.
    `outcome` "transient": the replay was clean and its result was applied (the `culprits`' devices get
    a strike); "reproduced": the data window `skip_data` was skipped and the step runs on the next data,
    no checkpoint loaded. Rank 0 reports it; the guardian records it as an incident."""

    type: Literal["ranks.step_replayed"] = "ranks.step_replayed"
    schema_version: Literal[1] = 1
    step: Step
    node: Name = Field(description="rank 0's node (the reporter)")
    kind: Literal["nan", "spike"]
    outcome: ReplayOutcome
    culprits: list[Rank] = Field(
        max_length=MAX_CULPRITS, description="the ranks whose loss was bad in the first execution"
    )
    values: list[RankValue] = Field(
        max_length=MAX_CULPRITS, description="the culprits' losses, first execution and replay"
    )
    data_position: Step
    skip_data: DataWindow | None = Field(None, description="[start, end) data positions skipped")
    held_s: float = Field(ge=0, description="seconds the held execution and its replay took")
    evidence: dict[str, Any] = Field(
        default_factory=dict, description=f"the spike rule's numbers (at most {MAX_EVIDENCE_BYTES} bytes)"
    )

    @field_validator("culprits")
    @classmethod
    def _unique_culprits(cls, culprits: list[int]) -> list[int]:
        if len(set(culprits)) != len(culprits):
            raise ValueError("names a rank more than once")
        return culprits

    @field_validator("values")
    @classmethod
    def _one_value_per_rank(cls, values: list[RankValue]) -> list[RankValue]:
        if len({v.rank for v in values}) != len(values):
            raise ValueError("gives a rank more than one value")
        return values

    @field_validator("evidence")
    @classmethod
    def _small_evidence(cls, evidence: dict[str, Any]) -> dict[str, Any]:
        if (size := evidence_size(evidence)) > MAX_EVIDENCE_BYTES:
            raise ValueError(f"is {size} bytes as JSON, over the limit of {MAX_EVIDENCE_BYTES}")
        return evidence


class ReportRefused(Message):
    """The agent refused what one of its ranks sent (a field out of bounds, a frame too large, a flood):
    the rank got the refusal as its reply, and the guardian records a `report_refused` incident. The
    agent sends at most one per job and `field` every `vigil_worker.relay.REPORT_EVERY_S`; `refused`
    counts the refusals since the last one it sent."""

    type: Literal["rank.report_refused"] = "rank.report_refused"
    schema_version: Literal[1] = 1
    rank: Rank
    node: Name
    report: Name = Field(description="the refused message's type (`frame` for a frame too large)")
    field: Name = Field(description="the field refused (`rate`: too many events; `frame`: too large)")
    reason: Text
    refused: Count = Field(ge=1, description="refusals of this field since the last report")


class CheckpointRefused(Message):
    """A checkpoint the ranks were told to load did not load: it failed its manifest (`reason` "hash":
    a file missing, resized or changed) or verified and still raised while loading ("load"). Rank 0
    reports it; the scheduler marks it bad (`scheduler_checkpoints.valid`, with the reason) and never
    resumes from it again, the guardian never rolls back to it."""

    type: Literal["checkpoint.refused"] = "checkpoint.refused"
    schema_version: Literal[1] = 1
    step: int = Field(ge=0, le=2**62, description="the checkpoint's step")
    path: str = Field(max_length=4096)
    reason: CheckpointRefusal
    message: str = Field(max_length=2000, description="what failed, for the operator")
    node: Name


class DeviceDiagnosed(Message):
    """The worker ran its known-answer check on one of its devices (`DiagnoseDevice`): a fixed-seed
    matmul in float32 compared with a float64 reference on the CPU, the same matmul run twice, and a
    reduction checked against its sum. `passed` False: the device computed a wrong answer (a worker's
    verdict, which marks the device unhealthy for good until an operator clears it); `error`: the check
    could not run (inconclusive: `passed` is None)."""

    type: Literal["device.diagnosed"] = "device.diagnosed"
    schema_version: Literal[1] = 1
    node: Name
    device: int = Field(ge=0, le=1_000_000)
    passed: bool | None = Field(description="None: the check could not run (see `error`)")
    checks: dict[str, float] = Field(
        default_factory=dict, max_length=16, description="each check's worst relative error"
    )
    error: str | None = Field(None, max_length=2000)
    duration_s: float = Field(ge=0)
    command_id: str = Field(max_length=128, description="the DiagnoseDevice that asked")


# --- stacks: a hang explained ---------------------------------------------------------------------------

MAX_STACKS_BYTES = 256 * 1024  # one node's StacksDumped, as JSON: the worker trims the dump to fit
MAX_THREADS = 64  # threads per rank in a dump
MAX_FRAMES = 64  # frames per thread (the innermost kept)


class StackFrame(BaseModel):
    """One Python frame, as py-spy names it: the function's qualified name, its file, its line."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    function: Name
    file: Text
    line: int | None = Field(None, ge=0, le=MAX_INT4)


class ThreadStack(BaseModel):
    """One thread of a rank, innermost frame first."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    name: Name = Field(description="the thread's name (`MainThread` runs the training loop)")
    frames: list[StackFrame] = Field(max_length=MAX_FRAMES, description="innermost first")


class RankStacks(BaseModel):
    """Every thread of one rank's Python process, or why it could not be read."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    rank: Rank
    pid: int = Field(ge=0, le=MAX_INT4)
    threads: list[ThreadStack] = Field(default_factory=list, max_length=MAX_THREADS)
    tool: Literal["py-spy", "faulthandler"] | None = Field(
        None, description="what read them: py-spy, else the rank's own faulthandler (names, not qualnames)"
    )
    error: Text | None = Field(None, description="why this rank's stacks are missing (py-spy's word)")


class StacksDumped(Message):
    """The worker of `node` dumped its ranks' Python stacks (every thread, py-spy) when the guardian judged
    the job hung (`DumpStacks`); the guardian groups them and names the outlier in the hang incident."""

    type: Literal["ranks.stacks_dumped"] = "ranks.stacks_dumped"
    schema_version: Literal[1] = 1
    node: Name
    command_id: Name = Field(description="the DumpStacks that asked")
    ranks: list[RankStacks] = Field(max_length=MAX_CULPRITS, description="this node's ranks of the job")
    duration_s: float = Field(ge=0)

    @field_validator("ranks")
    @classmethod
    def _small_dump(cls, ranks: list[RankStacks]) -> list[RankStacks]:
        size = sum(len(r.model_dump_json()) for r in ranks)
        if size > MAX_STACKS_BYTES:
            raise ValueError(f"is {size} bytes as JSON, over the limit of {MAX_STACKS_BYTES}")
        return ranks


class JobStateChanged(Message):
    type: Literal["job.state_changed"] = "job.state_changed"
    schema_version: Literal[1] = 1
    from_state: JobState | None
    to_state: JobState
    cause: str


SettingValue = bool | int | float | str | None  # a value of a `guardian:` field


class GuardianSettingsChanged(Message):
    """A job's guardian settings were changed while it runs (`PATCH /api/v1/jobs/{id}/guardian`), by the
    control plane only (`status(job, CONTROL)`). The guardian judges the job's steps stored after this
    event under `settings`, and every later attempt's launch carries them (the job's spec holds them)."""

    type: Literal["job.guardian_settings_changed"] = "job.guardian_settings_changed"
    schema_version: Literal[1] = 1
    revision: int = Field(ge=1, le=MAX_INT4, description="the job's changes so far, this one included")
    settings: GuardianSpec = Field(description="the whole `guardian:` section in effect from now on")
    changed: dict[Annotated[str, StringConstraints(max_length=64)], SettingValue] = Field(
        max_length=len(GuardianSpec.model_fields), description="what this change set: field -> new value"
    )
    by: Name = Field(description="who asked: the audit record's actor (`user:<name>`, `token:<digest>`)")


# --- job: commands -------------------------------------------------------------------------------------


class HaltJob(Command):
    """All ranks stop at the same step boundary and wait for a rollback, resume or cancel."""

    type: Literal["job.halt"] = "job.halt"
    schema_version: Literal[1] = 1
    reason: str
    incident_id: str | None = None


class RollbackJobV1(Command):
    """Version 1 of RollbackJob, still read: its `restart` flag gave it two meanings, now two messages
    (`decode` upgrades it to RollbackJob v2 or to RestartJob)."""

    type: Literal["job.rollback"] = "job.rollback"
    schema_version: Literal[1] = 1
    checkpoint: str
    step: Step = Field(description="the checkpoint's step")
    skip_data: DataWindow | None = Field(None, description="[start, end) data steps to skip")
    restart: bool = False
    reason: str
    incident_id: str | None = None

    def upgraded(self) -> RollbackJob | RestartJob:
        fields = self.model_dump(exclude={"schema_version", "type", "restart"})
        return RestartJob(**fields) if self.restart else RollbackJob(**fields)


class RollbackJob(Command):
    """The ranks load `checkpoint` in place (no process restart), skip `skip_data`, and train on.

    Version 2: in place only; a relaunch from a checkpoint is `RestartJob`."""

    type: Literal["job.rollback"] = "job.rollback"
    schema_version: Literal[2] = 2
    checkpoint: str
    step: Step = Field(description="the checkpoint's step")
    skip_data: DataWindow | None = Field(None, description="[start, end) data steps to skip")
    reason: str
    incident_id: str | None = None


class RestartJob(Command):
    """Stop the ranks and relaunch them (a new attempt) from `checkpoint`, skipping `skip_data`: for ranks
    that cannot roll back in place (hung in a collective, or a program that registered no in-place
    loader). The scheduler acts on it; the workers see the next attempt's LaunchJob."""

    type: Literal["job.restart"] = "job.restart"
    schema_version: Literal[1] = 1
    checkpoint: str
    step: Step = Field(description="the checkpoint's step")
    skip_data: DataWindow | None = Field(None, description="[start, end) data steps to skip")
    reason: str
    incident_id: str | None = None
    unhealthy: list[tuple[str, int]] = Field(
        default_factory=list, description="(node, device) to mark unhealthy before the relaunch"
    )


class DiagnoseDevice(Command):
    """The guardian asks the worker of `node` to run its known-answer check on `device`
    (`DeviceDiagnosed`): a job's own report of a transient fault there (a user program's `StepReplayed`)
    is evidence for the check, never a verdict by itself."""

    type: Literal["device.diagnose"] = "device.diagnose"
    schema_version: Literal[1] = 1
    node: str
    device: int = Field(ge=0, le=1_000_000)
    reason: str = Field(max_length=2000)


class DumpStacks(Command):
    """The guardian judged the job hung: each worker running its ranks dumps their Python stacks within
    `within_s` and reports them (`StacksDumped`). The hang's action waits for the dumps that long, no
    longer."""

    type: Literal["job.dump_stacks"] = "job.dump_stacks"
    schema_version: Literal[1] = 1
    within_s: float = Field(gt=0, le=60)
    reason: str = Field(max_length=2000)


class ResumeJob(Command):
    type: Literal["job.resume"] = "job.resume"
    schema_version: Literal[1] = 1
    reason: str = ""


class CancelJob(Command):
    type: Literal["job.cancel"] = "job.cancel"
    schema_version: Literal[1] = 1
    reason: str = ""


# Why the scheduler stops an attempt on the spot path (`PreemptJob`): a job of higher priority needs its
# devices (the job is requeued and resumes from the step it stopped at), or the attempt ran past its
# scheduling.time_limit (the job ends FAILED, its emergency checkpoint kept for the user to resume from).
StopKind = Literal["preempt", "time_limit"]


class PreemptJob(Command):
    """The scheduler stops the attempt's ranks on the spot path: the workers holding them send each a
    preemption notice; the ranks finish the step, write the emergency checkpoint (or snapshot) within
    VIGIL_PREEMPTION_GRACE_S and exit `preempted`; a rank still running after the grace is ended.
    Only this job's ranks of this attempt; every other rank on the node trains on."""

    type: Literal["job.preempt"] = "job.preempt"
    schema_version: Literal[1] = 1
    kind: StopKind
    reason: str = Field(max_length=2000)
    by_job: str | None = Field(None, max_length=64, description="the job that needs the devices (preempt)")


# --- incidents -----------------------------------------------------------------------------------------


class _IncidentFields(Message):
    type: Literal["incident.raised"] = "incident.raised"
    kind: IncidentKind
    step: Step | None = None
    rank: int | None = None
    node: str | None = None
    device: int | None = None
    message: str
    evidence: dict[str, Any] = Field(default_factory=dict)


class IncidentRaisedV1(_IncidentFields):
    """Version 1 of IncidentRaised, still read: its action "rollback" meant an in-place rollback or a
    relaunch (its evidence's `restart` said which); `decode` upgrades it to version 2."""

    schema_version: Literal[1] = 1
    action: IncidentActionV1

    def upgraded(self) -> IncidentRaised:
        fields = self.model_dump(exclude={"schema_version", "action"})
        restart = self.action == "rollback" and self.evidence.get("restart") is True
        return IncidentRaised(**fields, action="restart" if restart else self.action)


class IncidentRaised(_IncidentFields):
    """A fault the guardian (or the scheduler) found, and what was done about it (`action`).

    Version 2 adds the action "restart": the ranks relaunched from a checkpoint (`RestartJob`), apart
    from "rollback", the in-place rollback (`RollbackJob`)."""

    schema_version: Literal[2] = 2
    action: IncidentAction


# --- dead letters --------------------------------------------------------------------------------------


class MessageDeadLettered(Message):
    """A message a consumer terminated: malformed, or failing past its delivery limit."""

    type: Literal["message.dead_lettered"] = "message.dead_lettered"
    schema_version: Literal[1] = 1
    stream: str
    consumer: str
    subject: str
    reason: str
    payload: str = Field(description="the original payload, decoded as UTF-8 with replacement")
    num_delivered: int = Field(ge=0)


# --- registry ------------------------------------------------------------------------------------------

EVENT_CLASSES: tuple[type[Message], ...] = (
    NodeHeartbeat,
    GpuSampled,
    LaunchJob,
    StepCompleted,
    StepCompletedV2,
    StepCompletedV1,
    RankStarted,
    RankExited,
    CheckpointSaved,
    RanksHalted,
    RollbackCompleted,
    RestartRequested,
    OutOfMemoryHalted,
    StepReplayed,
    ReportRefused,
    CheckpointRefused,
    DeviceDiagnosed,
    StacksDumped,
    JobStateChanged,
    GuardianSettingsChanged,
    HaltJob,
    RollbackJob,
    RollbackJobV1,
    RestartJob,
    DiagnoseDevice,
    DumpStacks,
    ResumeJob,
    CancelJob,
    PreemptJob,
    IncidentRaised,
    IncidentRaisedV1,
    MessageDeadLettered,
)

REGISTRY: dict[tuple[str, int], type[Message]] = {
    (cls.model_fields["type"].default, cls.model_fields["schema_version"].default): cls
    for cls in EVENT_CLASSES
}

# --- what each subject carries: one union each (current versions), handled with `match` -----------------
# A receiver narrows what its consumer decoded (`expect`) and matches on the union with `assert_never`
# in the default branch: an event added to a union and handled by no receiver is a type error.

# `vigil.job.<job>.status.<node>`: what ranks, their agents and the scheduler say about a job.
StatusEvent = (
    RankStarted
    | RankExited
    | CheckpointSaved
    | RanksHalted
    | RollbackCompleted
    | RestartRequested
    | OutOfMemoryHalted
    | StepReplayed
    | ReportRefused
    | CheckpointRefused
    | DeviceDiagnosed
    | StacksDumped
    | JobStateChanged
    | GuardianSettingsChanged
)
# `vigil.job.<job>.cmd`: commands about a running job (the scheduler's input from the guardian and tools).
JobCommand = (
    HaltJob | RollbackJob | RestartJob | DiagnoseDevice | DumpStacks | ResumeJob | CancelJob | PreemptJob
)
# VIGIL_JOBS (launches, steps, status, in one order): a guardian share's input.
JobStreamEvent = LaunchJob | StepCompleted | StatusEvent
# What the guardian's decision core judges: its shares' job events and the devices' samples.
GuardianInput = JobStreamEvent | GpuSampled
# What telemetry stores (and counts in its metrics).
TelemetryInput = StepCompleted | GpuSampled | StatusEvent | IncidentRaised | LaunchJob

STATUS_EVENTS: tuple[type[Message], ...] = get_args(StatusEvent)
# older versions decoded and upgraded to a member of the union (RollbackJob v1: RollbackJob or RestartJob)
JOB_COMMANDS: tuple[type[Message], ...] = (*get_args(JobCommand), RollbackJobV1)
INCIDENTS: tuple[type[Message], ...] = (IncidentRaised, IncidentRaisedV1)


# Each union's guard: what a receiver narrows a decoded message with (`expect`).
def is_status(message: Message) -> TypeGuard[StatusEvent]:
    return isinstance(message, StatusEvent)


def is_job_command(message: Message) -> TypeGuard[JobCommand]:
    return isinstance(message, JobCommand)


def is_job_stream_event(message: Message) -> TypeGuard[JobStreamEvent]:
    return isinstance(message, JobStreamEvent)


def is_incident(message: Message) -> TypeGuard[IncidentRaised]:
    return isinstance(message, IncidentRaised)


def is_guardian_input(message: Message) -> TypeGuard[GuardianInput]:
    return isinstance(message, GuardianInput)


def is_telemetry_input(message: Message) -> TypeGuard[TelemetryInput]:
    return isinstance(message, TelemetryInput)


M = TypeVar("M", bound=Message)


def expect(message: Message, member: Callable[[Message], TypeGuard[M]], union: str) -> M:
    """`message` as a member of a receiver's union (`member` is its guard); MalformedMessage naming the
    type when it is not. A consumer decodes only what its subject carries (`subjects.CARRIES`), so this
    refuses only a message some other path handed to the wrong receiver."""
    if member(message):
        return message
    raise MalformedMessage(f"{type(message).__name__} ({message.type}) is not a {union}: refused")


_TYPE = re.compile(rb'"type":\s*"([^"]+)"')
_VERSION = re.compile(rb'"schema_version":\s*(\d+)')


def decode(data: bytes, expected: tuple[type[Message], ...] | None = None) -> Message:
    """Decode a message by its `type` and `schema_version`, upgraded to the current version of its type
    (a StepCompleted v1 or v2 is read as v3).

    Raises MalformedMessage (permanent) naming what is wrong: not JSON, an unknown
    type or version, a type this subject does not carry, or a field that fails validation.
    """
    # Fast path: the class is known (the subject carries one type: its current version is tried first)
    # or found from the envelope's type and version without building a dict; pydantic-core parses the
    # bytes once. Full validation (the `type` and `schema_version` literals included) still runs, so a
    # wrong guess only falls through to the slow path, which names what is wrong.
    if expected is not None and _one_type(expected):
        with contextlib.suppress(ValidationError):
            return expected[0].model_validate_json(data)
        if len(expected) == 1:
            return _decode_slow(data, expected)
    t, v = _TYPE.search(data), _VERSION.search(data)
    if t and v:
        cls = REGISTRY.get((t.group(1).decode(), int(v.group(1))))
        if cls is not None and (expected is None or cls in expected):
            with contextlib.suppress(ValidationError):
                return cls.model_validate_json(data).upgraded()
    return _decode_slow(data, expected)


@functools.cache
def _one_type(expected: tuple[type[Message], ...]) -> bool:
    return len({cls.model_fields["type"].default for cls in expected}) == 1


def _decode_slow(data: bytes, expected: tuple[type[Message], ...] | None) -> Message:
    try:
        raw = json.loads(data)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise MalformedMessage(f"not JSON: {exc}") from exc
    if not isinstance(raw, dict):
        raise MalformedMessage("not a JSON object")
    key = (raw.get("type"), raw.get("schema_version"))
    cls = REGISTRY.get(key)  # type: ignore[arg-type]
    if cls is None:
        raise MalformedMessage(f"unknown message type/schema_version {key!r}")
    if expected is not None and cls not in expected:
        names = ", ".join(sorted(c.__name__ for c in expected))
        raise MalformedMessage(f"{cls.__name__} is not carried on this subject (expected {names})")
    try:
        return cls.model_validate(raw).upgraded()
    except ValidationError as exc:
        fields = "; ".join(
            f"{'.'.join(str(p) for p in e['loc'])}: {e['msg']}" for e in exc.errors(include_url=False)
        )
        raise MalformedMessage(f"{cls.__name__}: {fields}") from exc
