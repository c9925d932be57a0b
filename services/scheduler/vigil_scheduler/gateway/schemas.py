"""HTTP shapes, kept apart from the internal models (the job row, bus events)."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import Any, get_args

from litestar.openapi.datastructures import ResponseSpec
from litestar.openapi.spec import OpenAPIMediaType, OpenAPIType, Operation, RequestBody, Schema
from pydantic import BaseModel, ConfigDict

from vigil_common.spec import Fault, JobSpec


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
    resume_from: str | None
    ended: str | None  # the cause that ended it; None while it runs


class JobDetailOut(JobOut):
    transitions: list[TransitionOut]
    attempts: list[AttemptOut]
    ranks: list[RankStatusOut]  # of the current attempt


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


class NodePage(Out):
    items: list[NodeOut]
    next: str | None


class GpuOut(DeviceOut):
    alive: bool
    latest: dict[str, Any] | None


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


_ERRORS = {
    401: "no bearer token, or the wrong one",
    404: "no such job",
    409: "the job's state forbids it",
    413: "the body is larger than VIGIL_MAX_BODY_BYTES",
    422: "a bad spec, path or query parameter; `fields` names each",
}


def error_responses(*codes: int) -> dict[int, ResponseSpec]:
    """The documented error answers of an endpoint (the OpenAPI `responses` besides its success)."""
    return {
        code: ResponseSpec(data_container=ErrorOut, description=_ERRORS[code], generate_examples=False)
        for code in codes
    }


class Health(Out):
    status: str
    checks: dict[str, str] = {}


def _section(name: str) -> Schema:
    """A spec section, described by the fields its model accepts (so the text follows the model)."""
    model = JobSpec.model_fields[name].annotation
    assert isinstance(model, type) and issubclass(model, BaseModel)
    return Schema(type=OpenAPIType.OBJECT, description=f"fields: {', '.join(model.model_fields)}")


def _fault() -> Schema:
    kinds = [get_args(c.model_fields["kind"].annotation)[0] for c in get_args(get_args(Fault)[0])]
    return Schema(
        type=OpenAPIType.OBJECT,
        description=f"an injected fault, for tests and demos: kind ({', '.join(kinds)}), step, rank, ...",
    )


_SPEC_SCHEMA = Schema(
    type=OpenAPIType.OBJECT,
    description="A job spec. Unknown fields are rejected; a 422 names each bad field.",
    required=["name"],
    properties={
        "name": Schema(type=OpenAPIType.STRING, pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]{0,62}$"),
        "priority": Schema(type=OpenAPIType.INTEGER, minimum=-1000, maximum=1000),
        **{k: _section(k) for k in ("resources", "model", "train", "data", "checkpoint", "guardian")},
        "faults": Schema(type=OpenAPIType.ARRAY, items=_fault()),
    },
    additional_properties=False,
)


@dataclass
class SubmitOperation(Operation):
    """The submit endpoint reads its body itself (JSON or YAML), so its schema is declared here."""

    def __post_init__(self) -> None:
        self.request_body = RequestBody(
            required=True,
            content={
                "application/json": OpenAPIMediaType(schema=_SPEC_SCHEMA),
                "application/yaml": OpenAPIMediaType(schema=_SPEC_SCHEMA),
            },
        )
