"""HTTP shapes, kept apart from the internal models (the job row, bus events): the answers are the SDK's
(`vigil.api`, which `vigil.Client` reads); the submit operation, which reads its body itself, is here."""

from __future__ import annotations

from dataclasses import dataclass

from litestar.openapi.datastructures import ResponseSpec
from litestar.openapi.spec import (
    OpenAPIMediaType,
    OpenAPIType,
    Operation,
    Parameter,
    Reference,
    RequestBody,
    Schema,
)

from vigil.api import ErrorOut

_ERRORS = {
    400: "a request that cannot be read: a body that is not JSON, or not of the form the endpoint takes",
    401: "no bearer token, or the wrong one",
    403: "an admin's token is needed",
    404: "no such job (or another user's: its existence is not revealed)",
    409: "the job's state forbids it, or an Idempotency-Key was used for another body",
    413: "the body is larger than VIGIL_MAX_BODY_BYTES",
    422: "a bad spec, path or query parameter; `fields` names each",
}


def error_responses(*codes: int) -> dict[int, ResponseSpec]:
    """The documented error answers of an endpoint (the OpenAPI `responses` besides its success), in Vigil's
    error shape (`ErrorOut`). A 400 is always among them: Litestar documents one for every endpoint that
    reads parameters or a body, in its own shape (`status_code`, `detail`), and the gateway answers any
    400 in Vigil's (`gateway.errors`); naming it here replaces Litestar's."""
    return {
        code: ResponseSpec(data_container=ErrorOut, description=_ERRORS[code], generate_examples=False)
        for code in sorted({400, *codes})
    }


# The job spec as pydantic validates it (`gateway.openapi` puts JobSpec's schema in the components).
_SPEC_SCHEMA = Reference(ref="#/components/schemas/JobSpec")


@dataclass
class SubmitOperation(Operation):
    """The submit endpoint reads its body itself (JSON or YAML), so its schema is declared here."""

    def __post_init__(self) -> None:
        self.parameters = [
            *(self.parameters or []),
            Parameter(
                name="Idempotency-Key",
                param_in="header",
                required=False,
                description="sent again with the same body: the job made the first time (200); kept a day",
                schema=Schema(
                    type=OpenAPIType.STRING, min_length=1, max_length=255, pattern=r"^[\x21-\x7e]+$"
                ),
            ),
        ]
        self.request_body = RequestBody(
            required=True,
            content={
                "application/json": OpenAPIMediaType(schema=_SPEC_SCHEMA),
                "application/yaml": OpenAPIMediaType(schema=_SPEC_SCHEMA),
            },
        )
