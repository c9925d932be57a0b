"""`PATCH /api/v1/jobs/{id}/guardian`: change a running job's guardian settings (`guardian_settings`)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from litestar import Controller, Request, patch
from litestar.di import NamedDependency
from litestar.exceptions import ClientException
from litestar.openapi.spec import OpenAPIMediaType, OpenAPIType, Operation, RequestBody, Schema
from litestar.params import RawBody
from litestar.status_codes import HTTP_200_OK

from vigil.api_guardian import GuardianSettingsOut
from vigil.spec import GuardianSpec
from vigil_scheduler import guardian_settings
from vigil_scheduler.core import Scheduler
from vigil_scheduler.gateway.auth import principal
from vigil_scheduler.gateway.params import JobId
from vigil_scheduler.gateway.schemas import error_responses

SchedulerDep = NamedDependency[Scheduler]
_BOUNDS = {
    "minimum": "minimum",
    "maximum": "maximum",
    "exclusiveMinimum": "exclusive_minimum",
    "exclusiveMaximum": "exclusive_maximum",
    "enum": "enum",
    "description": "description",
}


def _field(schema: dict[str, Any]) -> Schema:
    """One field of the guardian section, as its pydantic JSON schema describes it."""
    if "anyOf" in schema:
        return Schema(one_of=[_field(s) for s in schema["anyOf"]], description=schema.get("description"))
    kw = {ours: schema[theirs] for theirs, ours in _BOUNDS.items() if theirs in schema}
    return Schema(type=OpenAPIType(schema["type"]), **kw)


def _changes_schema() -> Schema:
    fields = GuardianSpec.model_json_schema()["properties"]
    return Schema(
        type=OpenAPIType.OBJECT,
        description="the guardian fields to change (the job spec's `guardian:` section); unknown fields are "
        "rejected, and a 422 names each bad field",
        properties={name: _field(schema) for name, schema in fields.items()},
        additional_properties=False,
        min_properties=1,
    )


@dataclass
class ChangeOperation(Operation):
    """The change reads its body itself (to name a bad field as the spec does): its schema is here."""

    def __post_init__(self) -> None:
        self.request_body = RequestBody(
            required=True, content={"application/json": OpenAPIMediaType(schema=_changes_schema())}
        )


def changes(body: bytes) -> dict[str, Any]:
    """The body's fields: a JSON object, else a 400 in Vigil's error shape."""
    try:
        found = json.loads(body)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ClientException(detail=f"the body is not JSON: {exc}") from exc
    if not isinstance(found, dict):
        raise ClientException(detail="the body must be a JSON object of guardian fields")
    return found


class GuardianController(Controller):
    path = "/jobs"
    tags = ["jobs"]

    @patch(
        "/{job_id:str}/guardian",
        status_code=HTTP_200_OK,
        summary="Change a queued or running job's guardian settings (audited); applied from the next step "
        "the guardian judges",
        operation_class=ChangeOperation,
        responses=error_responses(401, 404, 409, 413, 422),
    )
    async def change_guardian(
        self, request: Request, body: RawBody, scheduler: SchedulerDep, job_id: JobId
    ) -> GuardianSettingsOut:
        fields = changes(body)
        async with scheduler.tx() as conn:
            done = await guardian_settings.change(conn, job_id, fields, principal(request))
        return GuardianSettingsOut.model_validate(done)
