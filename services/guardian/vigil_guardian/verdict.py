"""What a detector says: a `Verdict` names the kind of fault, where it is, and the evidence."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from vigil.events import IncidentKind


@dataclass(frozen=True)
class Verdict:
    """One detector's finding. Pure data; the policy turns it into an incident and commands."""

    kind: IncidentKind
    message: str
    step: int | None = None
    rank: int | None = None
    node: str | None = None
    device: int | None = None
    evidence: dict[str, Any] = field(default_factory=dict)
