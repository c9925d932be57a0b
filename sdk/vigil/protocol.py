"""The rank protocol: one typed union per direction, and the frames of a rank's link to its agent.

Three directions, each one discriminated union handled with `match` by its one receiver:

| union | from -> to | carries |
| --- | --- | --- |
| `ToRanks` | guardian -> (command stream, agent) -> ranks | halt, in-place rollback, resume |
| `FromRanks` | ranks -> their agent -> the bus | steps, checkpoints, halted, rolled back, restart, OOM |
| `ToAgent` | scheduler -> worker agents | launch, cancel |

A rank holds no bus credential. It talks only to the worker agent that started it, over a Unix socket
in the data dir's `sockets` folder, and proves which rank it is with the token the agent minted for it
at launch (read once from an inherited pipe, `VIGIL_RANK_TOKEN_FD`, never from the environment; dead
when the attempt ends) and with its uid (the kernel's word). A Kubernetes rank pod links over TCP
instead: its agent admits its first hello (with no token) by the pod's IP and mints the token in the
`Welcome`. The agent checks every event a rank sends against that identity (job, attempt, rank, node)
and publishes it on its own node's subjects, which are the only ones its NATS user may publish on;
receivers check the node against the job's placement.

The recovery sequence, written once:

1. The guardian sees a bad step and publishes `HaltJob` or `RollbackJob` (in place) on the job's command
   subject, or `RestartJob` (relaunch: the scheduler starts the next attempt from the checkpoint).
2. Each agent feeds the job's commands, numbered 1, 2, ... in stream order, to its ranks (`Delivered`).
3. At the next step boundary the ranks agree, in the one small all-reduce they already make, on the
   highest command number any of them has; every rank acts on the commands up to it, in order.
4. `HaltJob`: the ranks stop at that boundary and rank 0 reports `RanksHalted`; they wait for a rollback
   or a resume. `RollbackJob`: they load the checkpoint in place with the program's registered loader,
   add the data-skip window and go on; rank 0 reports `RollbackCompleted`. A program that registered no
   loader reports `RestartRequested` instead and exits: the scheduler relaunches it from the checkpoint
   (`VIGIL_RESUME_FROM`).

Link frames are JSON, one per line (`encode_frame` / `decode_frame`), at most `MAX_FRAME_BYTES` each
(`MAX_RANK_FRAME_BYTES` from a rank). The agent decodes a rank's frames (`vigil_worker.relay`): a
publish frame whose event breaks a bound of its model is answered with an `Acked` error naming the
field, and the link goes on.
"""

from __future__ import annotations

from typing import Annotated, Literal, TypeGuard, TypeVar, get_args

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, ValidationError

from vigil import events as ev
from vigil.errors import MalformedMessage

# Each union once: its members, the annotated form pydantic validates by `type`, and its classes.
RankCommand = ev.HaltJob | ev.RollbackJob | ev.ResumeJob  # what ranks act on
RankReport = (
    ev.StepCompleted
    | ev.CheckpointSaved
    | ev.RanksHalted
    | ev.RollbackCompleted
    | ev.RestartRequested
    | ev.OutOfMemoryHalted
    | ev.StepReplayed
    | ev.CheckpointRefused
)  # what ranks report
AgentCommand = ev.LaunchJob | ev.CancelJob  # what a worker acts on

ToRanks = Annotated[RankCommand, Field(discriminator="type")]
FromRanks = Annotated[RankReport, Field(discriminator="type")]
ToAgent = Annotated[AgentCommand, Field(discriminator="type")]

TO_RANKS: tuple[type[ev.Message], ...] = get_args(RankCommand)
FROM_RANKS: tuple[type[ev.Message], ...] = get_args(RankReport)
TO_AGENT: tuple[type[ev.Message], ...] = get_args(AgentCommand)


def for_ranks(message: ev.Message) -> TypeGuard[RankCommand]:
    """Whether `message` is a command ranks act on (`RankCommand`)."""
    return isinstance(message, TO_RANKS)


MAX_FRAME_BYTES = 1024 * 1024
# What one frame from a rank may weigh: the largest event a rank sends (a StepReplayed naming
# MAX_CULPRITS ranks with their values, and 4 KB of evidence) is about 60 KB. The agent refuses a longer
# line and closes the link; the SDK refuses to send one.
MAX_RANK_FRAME_BYTES = 128 * 1024

# What the worker puts in a rank's environment for the SDK, besides torchrun's RANK, LOCAL_RANK,
# WORLD_SIZE, LOCAL_WORLD_SIZE, NODE_RANK, MASTER_ADDR and MASTER_PORT.
RANK_TOKEN_FD_ENV = "VIGIL_RANK_TOKEN_FD"  # an inherited pipe holding the rank's proof of identity
AGENT_SOCKET_ENV = "VIGIL_AGENT_SOCKET"  # where the agent listens: a Unix socket, or tcp://HOST:PORT (pods)
LINK_BATCH_ENV = "VIGIL_LINK_BATCH_S"  # how long a step's event may wait to go out with the next (seconds)
JOB_ID_ENV = "VIGIL_JOB_ID"
ATTEMPT_ENV = "VIGIL_ATTEMPT"
NODE_ENV = "VIGIL_NODE_NAME"
CHECKPOINT_ROOT_ENV = "VIGIL_CHECKPOINT_ROOT"  # the job's checkpoints go to <root>/<job id>/step_<n>/
CHECKPOINT_KEEP_ENV = "VIGIL_CHECKPOINT_KEEP"  # how many the job keeps (its spec's checkpoint.keep)
RESUME_FROM_ENV = "VIGIL_RESUME_FROM"  # the checkpoint this attempt starts from; unset: from scratch
SKIP_DATA_ENV = "VIGIL_SKIP_DATA"  # data windows to skip, "start:end,start:end" ([start, end) positions)
SNAPSHOT_DIR_ENV = "VIGIL_SNAPSHOT_DIR"  # the job's in-memory snapshots on this node (on /dev/shm)
EXIT_FILE_ENV = "VIGIL_EXIT_FILE"  # where the rank leaves its exit code (for a restarted worker)
# the job's spec as JSON (`vigil.Run.spec`); without `entrypoint.env`, which is the environment itself
# (so that the variable stays well under the kernel's 128 KiB per string with the largest argv)
JOB_SPEC_ENV = "VIGIL_JOB_SPEC"


# --- link frames ---------------------------------------------------------------------------------------


class _Frame(BaseModel):
    # A NaN or infinite loss is what a rank most needs to report: written as "NaN" / "Infinity", as
    # events are (the outer model's setting governs the events a frame carries).
    model_config = ConfigDict(extra="forbid", frozen=True, ser_json_inf_nan="strings")


class Hello(_Frame):
    """rank -> agent, first: who the rank says it is, and its token."""

    frame: Literal["hello"] = "hello"
    job_id: str = Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")
    attempt: int = Field(ge=1)
    rank: int = Field(ge=0)
    # empty only for a rank pod's first link: the agent admits it by the pod's IP and mints the token
    token: str = Field(pattern=r"^(|[^\s]{16,256})$")


class Welcome(_Frame):
    """agent -> rank: the identity is accepted; the job's commands follow as `Delivered` frames."""

    frame: Literal["welcome"] = "welcome"
    node: str
    token: str | None = None  # minted for a rank pod's first link: what its later hellos present


class Refused(_Frame):
    """agent -> rank: the hello (or a later frame) is refused; the agent closes the link."""

    frame: Literal["refused"] = "refused"
    reason: str


class Publish(_Frame):
    """rank -> agent: publish `event` (numbered `id` on this link, for its `Acked`)."""

    frame: Literal["publish"] = "publish"
    id: int = Field(ge=1)
    event: FromRanks


class Acked(_Frame):
    """agent -> rank: event `id` is stored on the bus (`error` None) or refused (`error` says why)."""

    frame: Literal["acked"] = "acked"
    id: int = Field(ge=1)
    error: str | None = None


class Delivered(_Frame):
    """agent -> rank: the job's `seq`-th command (1-based, the same number on every rank)."""

    frame: Literal["delivered"] = "delivered"
    seq: int = Field(ge=1)
    command: ToRanks


class Bye(_Frame):
    """rank -> agent: nothing more will be published; the agent closes after acking what it holds."""

    frame: Literal["bye"] = "bye"


RankFrame = Annotated[Hello | Publish | Bye, Field(discriminator="frame")]
AgentFrame = Annotated[Welcome | Refused | Acked | Delivered, Field(discriminator="frame")]
_AGENT_FRAME: TypeAdapter[Welcome | Refused | Acked | Delivered] = TypeAdapter(AgentFrame)


def encode_frame(frame: _Frame) -> bytes:
    """One frame as one line of JSON."""
    data = frame.model_dump_json().encode() + b"\n"
    if len(data) > MAX_FRAME_BYTES:
        raise ValueError(f"a {type(frame).__name__} frame of {len(data)} bytes exceeds {MAX_FRAME_BYTES}")
    return data


def decode_agent_frame(line: bytes) -> Welcome | Refused | Acked | Delivered:
    """A frame an agent sent; MalformedMessage naming the field that is wrong."""
    return _decode(_AGENT_FRAME, line)


T = TypeVar("T")


def _decode(adapter: TypeAdapter[T], line: bytes) -> T:
    if len(line) > MAX_FRAME_BYTES:
        raise MalformedMessage(f"frame of {len(line)} bytes exceeds {MAX_FRAME_BYTES}")
    try:
        return adapter.validate_json(line)
    except ValidationError as exc:
        raise MalformedMessage(f"bad frame: {bad_fields(exc)}") from exc


def bad_fields(exc: ValidationError) -> str:
    """The fields a frame got wrong, and why (the first five)."""
    return "; ".join(
        f"{'.'.join(str(p) for p in e['loc'])}: {e['msg']}" for e in exc.errors(include_url=False)[:5]
    )
