"""The one registry of bus subjects and JetStream streams.

No service spells a subject by hand: it calls a builder here (`subjects.step(job_id, node)`),
and `tests/unit/common/test_subjects.py` fails when a `"vigil.` literal appears elsewhere.

A job's step and status subjects end with their origin: the node whose worker published the event, or
`CONTROL` for the control plane (the scheduler's state changes). The NATS server lets a worker's user
publish only on its own node's subjects (`vigil_common.credentials`), so a receiver knows which node an
event came from and checks it against the job's placement (`vigil_common.origin`).
"""

from __future__ import annotations

import base64
import re
from dataclasses import dataclass, field

from vigil import events as ev

PREFIX = "vigil"
_TOKEN = re.compile(r"^[A-Za-z0-9_-]{1,64}$")


def token(value: str, what: str = "subject token") -> str:
    """Validate one subject token: letters, digits, `_` and `-` only (no `.`, `*`, `>` or spaces)."""
    if not _TOKEN.match(value):
        raise ValueError(
            f"{what} {value!r} is not a valid NATS subject token: use 1-64 letters, digits, '_' or '-'"
        )
    return value


# The origin of the control plane's status events; no node name can take it (`node_token`).
CONTROL = "_control"


def node_token(node: str) -> str:
    """Validate a node name as a subject token; a leading `_` is reserved (`CONTROL`)."""
    token(node, "node name")
    if node.startswith("_"):
        raise ValueError(f"node name {node!r} may not start with '_' (reserved for the control plane)")
    return node


def origin_token(origin: str) -> str:
    """A status subject's origin: a node name, or `CONTROL`."""
    return origin if origin == CONTROL else node_token(origin)


# --- builders -------------------------------------------------------------------------------------------


def heartbeat(node: str) -> str:
    return f"{PREFIX}.node.{node_token(node)}.heartbeat"


def gpu(node: str) -> str:
    return f"{PREFIX}.node.{node_token(node)}.gpu"


def ping(node: str) -> str:
    """A node's worker answers a request here while its NATS connection stands (core NATS, never stored):
    the scheduler asks when it has reason to think the node gone (`vigil_common.bus.presence`)."""
    return f"{PREFIX}.node.{node_token(node)}.ping"


def launch(job_id: str) -> str:
    return f"{PREFIX}.job.{token(job_id, 'job id')}.launch"


def step(job_id: str, node: str) -> str:
    """A step of one of `node`'s ranks."""
    return f"{PREFIX}.job.{token(job_id, 'job id')}.step.{node_token(node)}"


def status(job_id: str, origin: str) -> str:
    """A status event from `origin`: a node (its worker, for itself and its ranks) or CONTROL."""
    return f"{PREFIX}.job.{token(job_id, 'job id')}.status.{origin_token(origin)}"


def job_steps(job_id: str) -> str:
    """Every step of one job, from any node (a wildcard, for watchers)."""
    return f"{PREFIX}.job.{token(job_id, 'job id')}.step.*"


def job_status(job_id: str) -> str:
    """Every status event of one job, from any origin (a wildcard, for watchers)."""
    return f"{PREFIX}.job.{token(job_id, 'job id')}.status.*"


def node_steps(node: str) -> str:
    """Every job's steps from `node` (a wildcard, for that node's worker's permissions)."""
    return f"{PREFIX}.job.*.step.{node_token(node)}"


def node_status(node: str) -> str:
    """Every job's status events from `node` (a wildcard, for that node's worker's permissions)."""
    return f"{PREFIX}.job.*.status.{node_token(node)}"


def cmd(job_id: str) -> str:
    return f"{PREFIX}.job.{token(job_id, 'job id')}.cmd"


def incident(job_id: str) -> str:
    return f"{PREFIX}.incident.{token(job_id, 'job id')}"


def node_incident(node: str) -> str:
    """Incidents about a node's device that runs no job (a `gpu_health` incident with job_id None)."""
    return f"{PREFIX}.incident.node_{node_token(node)}"


# --- guardian shares and the stored form of VIGIL_JOBS ---------------------------------------------------
#
# The guardians divide the jobs into SHARES shares by a hash of the job id. VIGIL_JOBS stores each event
# under its share from the start: the stream's own subject transform (`JOBS.transform`, applied by the
# server as it stores) turns a published `vigil.job.<job>.<rest>` into the stored
# `vigil.share.<share>.job.<job>.<rest>`, so each share is one subject space of VIGIL_JOBS with one durable
# consumer, in VIGIL_JOBS's order, and nothing is copied. Publishers keep the published form; every reader
# of VIGIL_JOBS (consumers, scans, watches, stored reads) filters on the stored form, which `stored` gives
# and the bus applies. A guardian holds shares, not jobs (`vigil_guardian.shares.Shares`).
#
# The layout before (VIGIL_JOBS stored the published subjects; the server copied them into a stream
# VIGIL_SHARES) is migrated in place (`Bus.ensure_streams`): the transform is added to the existing
# stream, VIGIL_SHARES is deleted, and the messages stored before keep their published subjects until
# VIGIL_JOBS's retention drops them. While the stream holds such a message, readers read both forms
# (`reads`): no copy, no window in which a publish fails, one order.

SHARES = 16
SHARE_PREFIX = f"{PREFIX}.share"
_JOB_PREFIX = f"{PREFIX}.job"
# Streams of an earlier release that `Bus.ensure_streams` deletes.
RETIRED_STREAMS = ("VIGIL_SHARES",)


def share_of(job_id: str) -> int:
    """The share of a job: the NATS server's `partition(SHARES, <job>)` (FNV-1a, 32 bits, modulo SHARES),
    so the guardian and the server's transform agree (tests/integration/common/test_shares.py)."""
    h = 0x811C9DC5
    for b in job_id.encode():
        h = ((h ^ b) * 0x01000193) & 0xFFFFFFFF
    return h % SHARES


def share_events(share: int) -> str:
    """Every event of the jobs of one share, as VIGIL_JOBS stores them (a wildcard, for that share's
    consumer)."""
    return f"{SHARE_PREFIX}.{check_share(share)}.>"


def job_events(job_id: str) -> str:
    """Everything VIGIL_JOBS keeps of one job: launches, status and steps (a wildcard)."""
    return f"{_JOB_PREFIX}.{token(job_id, 'job id')}.>"


def stored(subject: str) -> str:
    """A subject (or wildcard) of VIGIL_JOBS as the stream stores it: `vigil.job.j1.step.n1` ->
    `vigil.share.<share_of(j1)>.job.j1.step.n1`, `vigil.job.*.status.*` -> `vigil.share.*.job.*.status.*`,
    `vigil.job.>` -> `vigil.share.*.job.>`. A stored form, and a subject of another stream, as it is."""
    parts = subject.split(".")
    if parts[:2] != [PREFIX, "job"] or len(parts) < 3 or parts[3:4] == ["cmd"]:  # commands: VIGIL_COMMANDS
        return subject
    job = parts[2]
    share = "*" if job in ("*", ">") else str(share_of(job))
    rest = parts[2:] if job != ">" else ["*", ">"]
    return ".".join([PREFIX, "share", share, "job", *rest])


def published(subject: str) -> str:
    """A subject (or wildcard) as it was published: `vigil.share.3.job.j1.step.n1` -> `vigil.job.j1.step.n1`,
    `vigil.share.3.>` -> `vigil.job.>`; any other subject as it is."""
    parts = subject.split(".")
    if parts[:2] != [PREFIX, "share"] or len(parts) < 4:
        return subject
    if parts[3] == ">":
        return f"{_JOB_PREFIX}.>"
    return ".".join([PREFIX, *parts[3:]])


def reads(pattern: str, *, legacy: bool) -> tuple[str, ...]:
    """The filter subjects a reader of `pattern` (either form) uses on its stream: the stored form and,
    with `legacy` (VIGIL_JOBS may still hold messages stored before the transform), the published form
    those were stored under. A legacy message of a share pattern may be another share's: `holds` says."""
    pattern_stored = stored(pattern)
    if not legacy or not pattern_stored.startswith(SHARE_PREFIX + "."):
        return (pattern_stored,)
    return (pattern_stored, published(pattern_stored))


def holds(pattern: str, subject: str) -> bool:
    """Whether a message stored on `subject` (either form) is one a reader of `pattern` (either form)
    wants: its stored form matches the pattern's (a legacy message is placed in its job's share)."""
    return _matches(stored(pattern), stored(subject))


def check_share(share: int) -> int:
    if not 0 <= share < SHARES:
        raise ValueError(f"share {share} is outside 0..{SHARES - 1}")
    return share


def dead_letter(stream: str) -> str:
    return f"{PREFIX}.deadletter.{token(stream, 'stream name')}"


# Bench and health probes use core request/reply, never stored.
def probe(name: str) -> str:
    return f"{PREFIX}.probe.{token(name, 'probe name')}"


# --- wildcards (for consumers that watch every node or job) ------------------------------------------

ALL_HEARTBEATS = f"{PREFIX}.node.*.heartbeat"
ALL_GPU = f"{PREFIX}.node.*.gpu"
ALL_PINGS = f"{PREFIX}.node.*.ping"
ALL_LAUNCHES = f"{PREFIX}.job.*.launch"
ALL_STEPS = f"{PREFIX}.job.*.step.*"
ALL_STATUS = f"{PREFIX}.job.*.status.*"
CONTROL_STATUS = f"{PREFIX}.job.*.status.{CONTROL}"  # the control plane's status events
# Everything VIGIL_JOBS keeps about every job (launch, status and step; commands live in VIGIL_COMMANDS).
ALL_JOB_EVENTS = f"{PREFIX}.job.>"
ALL_CMDS = f"{PREFIX}.job.*.cmd"
ALL_INCIDENTS = f"{PREFIX}.incident.*"
ALL_DEAD_LETTERS = f"{PREFIX}.deadletter.*"


def kind_of(subject: str) -> str:
    """The registry name of a concrete subject (either form): `vigil.job.j1.step.n1` -> `step`."""
    parts = published(subject).split(".")
    if len(parts) == 4 and parts[:2] == [PREFIX, "node"]:
        return parts[3]
    if len(parts) == 4 and parts[:2] == [PREFIX, "job"] and parts[3] in ("launch", "cmd"):
        return parts[3]
    if len(parts) == 5 and parts[:2] == [PREFIX, "job"] and parts[3] in ("step", "status"):
        return parts[3]
    if len(parts) == 3 and parts[0] == PREFIX and parts[1] in ("incident", "deadletter", "probe"):
        return parts[1]
    raise ValueError(f"subject {subject!r} is not in Vigil's registry")


def token_at(subject: str, index: int = 2) -> str:
    """The node or job token of a concrete subject (`vigil.job.<job>.step.<node>` -> `<job>`)."""
    return published(subject).split(".")[index]


def origin_of(subject: str) -> str:
    """Where a step or status event came from: its subject's node, or CONTROL."""
    parts = published(subject).split(".")
    if len(parts) != 5 or parts[3] not in ("step", "status"):
        raise ValueError(f"subject {subject!r} carries no origin")
    return parts[4]


# What each subject carries: a consumer decodes only these types there.
CARRIES: dict[str, tuple[type[ev.Message], ...]] = {
    "heartbeat": (ev.NodeHeartbeat,),
    "gpu": (ev.GpuSampled,),
    "launch": (ev.LaunchJob,),
    "step": (ev.StepCompleted, ev.StepCompletedV2, ev.StepCompletedV1),  # current version first
    "status": ev.STATUS_EVENTS,
    "cmd": ev.JOB_COMMANDS,
    "incident": ev.INCIDENTS,
    "deadletter": (ev.MessageDeadLettered,),
}


# --- streams --------------------------------------------------------------------------------------------

_DAY = 86_400.0
_HOUR = 3600.0
_GIB = 1024**3


@dataclass(frozen=True)
class StreamSpec:
    """A JetStream stream with explicit limits. Created idempotently at start (`Bus.ensure_streams`)."""

    name: str
    subjects: tuple[str, ...]  # what it listens on
    max_age_s: float
    max_bytes: int
    max_msgs: int = -1
    max_msg_size: int = 1024 * 1024
    discard_new: bool = False
    duplicate_window_s: float = 120.0
    description: str = ""
    extra: dict[str, object] = field(default_factory=dict)
    # The subject transform the server applies as it stores (source, destination): see `stored`.
    transform: tuple[str, str] | None = None


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
    # stored under the job's share (`stored`): the server's partition() is `share_of`
    transform=(
        f"{_JOB_PREFIX}.*.>",
        f"{SHARE_PREFIX}.{{{{partition({SHARES},1)}}}}.job.{{{{wildcard(1)}}}}.>",
    ),
)
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


# --- object store buckets -------------------------------------------------------------------------------


@dataclass(frozen=True)
class BucketSpec:
    """A JetStream Object Store bucket: a stream `OBJ_<name>` of chunks (`$O.<name>.C.<nuid>`) and of one
    metadata message per object (`$O.<name>.M.<base64url(object name)>`), nats-py's and the server's
    layout. Made at its first put (`Bus.put_object`), kept on the streams' replicas."""

    name: str
    max_bytes: int
    description: str = ""

    @property
    def stream(self) -> str:
        return f"OBJ_{self.name}"

    def meta(self, obj: str) -> str:
        """The subject of an object's metadata (its last message is the object's current state)."""
        return f"$O.{self.name}.M.{base64.urlsafe_b64encode(obj.encode()).decode()}"

    def chunks(self, nuid: str) -> str:
        """The subject of one stored version's chunks (`nuid`: the object's metadata names it)."""
        return f"$O.{self.name}.C.{token(nuid, 'object nuid')}"

    @property
    def all_subjects(self) -> str:
        return f"$O.{self.name}.>"


# Code packages by SHA-256 (`vigil.codepack`): uploaded through the gateway (the scheduler puts them), read
# by each worker that runs a job of one. No age limit: a pack is kept while a job that runs it is kept
# (`vigil_scheduler.code_packs.sweep` deletes the others); a full bucket refuses new packs.
CODE = BucketSpec(
    name="VIGIL_CODE",
    max_bytes=4 * _GIB,  # JetStream reserves it at creation, as the streams' limits
    description="code packages (vigil submit --code), one object per SHA-256",
)
BUCKETS: tuple[BucketSpec, ...] = (CODE,)


def stream_for(subject: str) -> StreamSpec:
    """The stream that stores a concrete subject (either form)."""
    kind = kind_of(subject)
    as_published = published(subject)
    for spec in STREAMS:
        for pattern in spec.subjects:
            if _matches(pattern, as_published):
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
