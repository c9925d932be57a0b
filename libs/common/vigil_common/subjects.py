"""The one registry of bus subjects and JetStream streams.

No service spells a subject by hand: it calls a builder here (`subjects.step(job_id)`),
and `tests/unit/common/test_subjects.py` fails when a `"vigil.` literal appears elsewhere.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from vigil_common import events as ev

PREFIX = "vigil"
_TOKEN = re.compile(r"^[A-Za-z0-9_-]{1,64}$")


def token(value: str, what: str = "subject token") -> str:
    """Validate one subject token: letters, digits, `_` and `-` only (no `.`, `*`, `>` or spaces)."""
    if not _TOKEN.match(value):
        raise ValueError(
            f"{what} {value!r} is not a valid NATS subject token: use 1-64 letters, digits, '_' or '-'"
        )
    return value


# --- builders -------------------------------------------------------------------------------------------


def heartbeat(node: str) -> str:
    return f"{PREFIX}.node.{token(node, 'node name')}.heartbeat"


def gpu(node: str) -> str:
    return f"{PREFIX}.node.{token(node, 'node name')}.gpu"


def launch(job_id: str) -> str:
    return f"{PREFIX}.job.{token(job_id, 'job id')}.launch"


def step(job_id: str) -> str:
    return f"{PREFIX}.job.{token(job_id, 'job id')}.step"


def status(job_id: str) -> str:
    return f"{PREFIX}.job.{token(job_id, 'job id')}.status"


def cmd(job_id: str) -> str:
    return f"{PREFIX}.job.{token(job_id, 'job id')}.cmd"


def incident(job_id: str) -> str:
    return f"{PREFIX}.incident.{token(job_id, 'job id')}"


def node_incident(node: str) -> str:
    """Incidents about a node's device that runs no job (a `gpu_health` incident with job_id None)."""
    return f"{PREFIX}.incident.node_{token(node, 'node name')}"


def dead_letter(stream: str) -> str:
    return f"{PREFIX}.deadletter.{token(stream, 'stream name')}"


# Bench and health probes use core request/reply, never stored.
def probe(name: str) -> str:
    return f"{PREFIX}.probe.{token(name, 'probe name')}"


# --- wildcards (for consumers that watch every node or job) ------------------------------------------

ALL_HEARTBEATS = f"{PREFIX}.node.*.heartbeat"
ALL_GPU = f"{PREFIX}.node.*.gpu"
ALL_LAUNCHES = f"{PREFIX}.job.*.launch"
ALL_STEPS = f"{PREFIX}.job.*.step"
ALL_STATUS = f"{PREFIX}.job.*.status"
# Everything VIGIL_JOBS keeps about every job (launch, status and step; commands live in VIGIL_COMMANDS).
ALL_JOB_EVENTS = f"{PREFIX}.job.>"
ALL_CMDS = f"{PREFIX}.job.*.cmd"
ALL_INCIDENTS = f"{PREFIX}.incident.*"
ALL_DEAD_LETTERS = f"{PREFIX}.deadletter.*"


def kind_of(subject: str) -> str:
    """The registry name of a concrete subject: `vigil.job.j1.step` -> `step`."""
    parts = subject.split(".")
    if len(parts) == 4 and parts[:2] == [PREFIX, "node"]:
        return parts[3]
    if len(parts) == 4 and parts[:2] == [PREFIX, "job"]:
        return parts[3]
    if len(parts) == 3 and parts[0] == PREFIX and parts[1] in ("incident", "deadletter", "probe"):
        return parts[1]
    raise ValueError(f"subject {subject!r} is not in Vigil's registry")


def token_at(subject: str, index: int = 2) -> str:
    """The node or job token of a concrete subject (`vigil.job.<job>.step` -> `<job>`)."""
    return subject.split(".")[index]


# What each subject carries: a consumer decodes only these types there.
CARRIES: dict[str, tuple[type[ev.Message], ...]] = {
    "heartbeat": (ev.NodeHeartbeat,),
    "gpu": (ev.GpuSampled,),
    "launch": (ev.LaunchJob,),
    "step": (ev.StepCompleted, ev.StepCompletedV1),  # current version first
    "status": ev.STATUS_EVENTS,
    "cmd": ev.JOB_COMMANDS,
    "incident": (ev.IncidentRaised,),
    "deadletter": (ev.MessageDeadLettered,),
}


# --- streams --------------------------------------------------------------------------------------------

_DAY = 86_400.0
_GIB = 1024**3


@dataclass(frozen=True)
class StreamSpec:
    """A JetStream stream with explicit limits. Created idempotently at start (`Bus.ensure_streams`)."""

    name: str
    subjects: tuple[str, ...]
    max_age_s: float
    max_bytes: int
    max_msgs: int = -1
    max_msg_size: int = 1024 * 1024
    discard_new: bool = False
    duplicate_window_s: float = 120.0
    description: str = ""
    extra: dict[str, object] = field(default_factory=dict)


NODES = StreamSpec(
    name="VIGIL_NODES",
    subjects=(ALL_HEARTBEATS, ALL_GPU),
    max_age_s=1 * _DAY,
    max_bytes=2 * _GIB,
    description="worker heartbeats and per-device samples",
)
# One stream for what happens in a job, so that a job's launch, status and step events have one order:
# the order the server stored them in. A rank publishes `CheckpointSaved` and waits for its ack
# before its next step, so a consumer of this stream (the guardian) knows that checkpoint before
# it judges that step; with steps in a stream of their own there was no order between the two.
JOBS = StreamSpec(
    name="VIGIL_JOBS",
    subjects=(ALL_LAUNCHES, ALL_STATUS, ALL_STEPS),
    max_age_s=30 * _DAY,
    max_bytes=10 * _GIB,
    description="launches, job/rank status events and one event per rank per training step",
)
# Steps had a stream of their own before: `Bus.ensure_streams` moves a deployment that still has it
# (the steps some consumer had not acknowledged are copied into VIGIL_JOBS; it is then deleted).
LEGACY_STEPS = "VIGIL_STEPS"
RETIRED_STEPS = f"{PREFIX}.retired.steps"  # its subject while it is being emptied
# Consumers the guardian had on VIGIL_JOBS before it read the stream through one consumer.
LEGACY_CONSUMERS = ("guardian-status", "guardian-launches")

COMMANDS = StreamSpec(
    name="VIGIL_COMMANDS",
    subjects=(ALL_CMDS,),
    max_age_s=7 * _DAY,
    max_bytes=1 * _GIB,
    max_msgs=1_000_000,
    # A full command stream refuses new commands (the publisher sees the error) instead
    # of silently evicting an older command nobody has acted on yet.
    discard_new=True,
    description="halt, rollback, resume and cancel commands",
)
INCIDENTS = StreamSpec(
    name="VIGIL_INCIDENTS",
    subjects=(ALL_INCIDENTS,),
    max_age_s=90 * _DAY,
    max_bytes=1 * _GIB,
    description="what the guardian saw and did",
)
DEAD_LETTERS = StreamSpec(
    name="VIGIL_DEAD_LETTERS",
    subjects=(ALL_DEAD_LETTERS,),
    max_age_s=30 * _DAY,
    max_bytes=1 * _GIB,
    description="messages consumers terminated, with the reason",
)

STREAMS: tuple[StreamSpec, ...] = (NODES, JOBS, COMMANDS, INCIDENTS, DEAD_LETTERS)


def stream_for(subject: str) -> StreamSpec:
    """The stream that stores a concrete subject."""
    kind = kind_of(subject)
    for spec in STREAMS:
        for pattern in spec.subjects:
            if _matches(pattern, subject):
                return spec
    raise ValueError(f"no stream stores subject {subject!r} ({kind})")


def matches(pattern: str, subject: str) -> bool:
    """True when `subject` matches the NATS wildcard `pattern` (`*`: one token, `>`: the rest)."""
    return _matches(pattern, subject)


def _matches(pattern: str, subject: str) -> bool:
    p, s = pattern.split("."), subject.split(".")
    if p and p[-1] == ">":
        return len(s) >= len(p) and all(a in ("*", b) for a, b in zip(p[:-1], s, strict=False))
    return len(p) == len(s) and all(a in ("*", b) for a, b in zip(p, s, strict=True))
