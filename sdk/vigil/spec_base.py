"""The base of every job-spec section (`vigil.spec`): strict models, and errors that name their field."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict

# What the guardian does about a fault: a `GuardianSpec` field per kind, and the `action` an
# `IncidentRaised` reports (`vigil.events`).
Action = Literal["alert", "halt", "rollback", "fail"]


class FieldError(ValueError):
    """A cross-field check's failure that names the field it is about (`faults.0.rank`)."""

    def __init__(self, field: str, message: str) -> None:
        self.field = field
        super().__init__(message)


class StrictModel(BaseModel):
    """Base for spec sections: unknown fields are errors, values are validated on assignment, nothing is
    coerced (`steps: "10"` and `steps: true` are refused), floats are finite."""

    model_config = ConfigDict(
        extra="forbid", validate_assignment=True, frozen=True, strict=True, allow_inf_nan=False
    )
