"""The HTTP API's answer to a change of a job's guardian settings (`PATCH /api/v1/jobs/{id}/guardian`),
beside `vigil.api`'s: what the gateway returns and `vigil.Client.set_guardian` reads."""

from __future__ import annotations

from datetime import datetime
from typing import Any

from vigil.api import Out


class GuardianSettingsOut(Out):
    """A change of a job's guardian settings (`PATCH /api/v1/jobs/{id}/guardian`)."""

    job_id: str
    revision: int  # the job's changes so far, this one included
    changed: dict[str, Any]  # field -> the value set
    settings: dict[str, Any]  # the whole `guardian:` section in effect from the step the guardian judges next
    by: str  # who asked (the audit record's actor)
    changed_at: datetime
    from_step: int | None = None  # the first step judged under it (None: none yet)
