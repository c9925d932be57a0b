"""The base of every job-spec section (`vigil.spec`): strict models, and errors that name their field."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict

# What the guardian does about a fault: a `GuardianSpec` field per kind, and the `action` an
# `IncidentRaised` reports (`vigil.events`).
Action = Literal["alert", "halt", "rollback", "fail"]


def not_a_bool(value: Any) -> Any:
    """For a number field, as a `BeforeValidator`: `true`/`false` is refused (Python's False == 0 and
    True == 1 would otherwise pass as numbers); anything else goes on to the field's own validation."""
    if isinstance(value, bool):
        raise ValueError(f"must be a number, not the boolean {str(value).lower()}")
    return value


def only_a_bool(value: Any) -> Any:
    """For a boolean field, as a `BeforeValidator`: only `true` or `false` (not 1, "yes" or "true", which
    pydantic's lax mode would take)."""
    if not isinstance(value, bool):
        raise ValueError(f"must be true or false, not {value!r}")
    return value


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
