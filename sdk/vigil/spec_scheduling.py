"""How the queue treats a job (`scheduling:`): may a job of higher priority preempt it, and how long may it
run. Re-exported by `vigil.spec`.

- `preemptible`: a preempted job gets the spot path (its ranks finish the step, snapshot or write the
  emergency checkpoint within the grace period, and it is requeued to resume from exactly that step).
  Unset: the operator's rule decides (`VIGIL_PREEMPTIBLE_BELOW_PRIORITY`: jobs of lower priority are
  preemptible). `false`: never a victim.
- `time_limit`: how long an attempt may run, as seconds or a duration (`"90s"`, `"30m"`, `"2h"`,
  `"1d"`, `"1h30m"`). The operator sets a default and a maximum (`VIGIL_TIME_LIMIT_DEFAULT_S`,
  `VIGIL_TIME_LIMIT_MAX_S`). The queue's backfill reads it to know when a job's devices free up; a job
  past it ends as Slurm's does, after the grace period and an emergency checkpoint, with the reason.
"""

from __future__ import annotations

import re
from typing import Any

from pydantic import Field, SerializerFunctionWrapHandler, field_validator, model_serializer

from vigil.spec_base import StrictModel

# The longest time limit a spec may name (a year): past it a limit means nothing a queue can plan with.
MAX_TIME_LIMIT_S = 365 * 86400.0
_UNITS = {"d": 86400.0, "h": 3600.0, "m": 60.0, "s": 1.0}
_DURATION = re.compile(r"(?:(\d+(?:\.\d+)?)([dhms]))")


def parse_duration(text: str) -> float:
    """Seconds in a duration such as `"90s"`, `"30m"`, `"2h"`, `"1d"` or `"1h30m"` (units d, h, m, s, largest
    first, each at most once); a bare number is seconds. ValueError naming the text otherwise."""
    value = text.strip().lower()
    if re.fullmatch(r"\d+(?:\.\d+)?", value):
        return float(value)
    parts = _DURATION.findall(value)
    units = [unit for _, unit in parts]
    ordered = sorted(set(units), key=list(_UNITS).index)
    if not parts or "".join(n + u for n, u in parts) != value or units != ordered:
        raise ValueError(
            f"{text!r} is not a duration: write seconds (3600) or amounts with units d, h, m, s, largest "
            "first (90s, 30m, 2h, 1d, 1h30m)"
        )
    return sum(float(n) * _UNITS[u] for n, u in parts)


def format_duration(seconds: float) -> str:
    """`seconds` as the shortest duration `parse_duration` reads back (`5400.0` -> `"1h30m"`)."""
    if seconds != int(seconds):
        return f"{seconds:g}s"
    rest, out = int(seconds), []
    for unit, size in _UNITS.items():
        amount, rest = divmod(rest, int(size))
        if amount:
            out.append(f"{amount}{unit}")
    return "".join(out) or "0s"


class SchedulingSpec(StrictModel):
    preemptible: bool | None = Field(
        None,
        description="may a job of higher priority preempt this one (without lost work: it resumes from the "
        "step it stopped at); unset: the operator's rule (VIGIL_PREEMPTIBLE_BELOW_PRIORITY) decides",
    )
    time_limit: float | None = Field(
        None,
        description="how long an attempt may run: seconds, or a duration (90s, 30m, 2h, 1d, 1h30m); past "
        "it the job is ended after the grace period and an emergency checkpoint; unset: the operator's "
        "default",
    )

    @field_validator("time_limit", mode="before")
    @classmethod
    def _duration(cls, v: Any) -> Any:
        if isinstance(v, str):
            v = parse_duration(v)
        if isinstance(v, bool) or not isinstance(v, int | float) or v is None:
            return v  # None passes; anything else is refused by the field's own type check
        if not 1 <= v <= MAX_TIME_LIMIT_S:
            raise ValueError(f"scheduling.time_limit must be between 1 s and 365 days (got {v:g} s)")
        return float(v)

    @model_serializer(mode="wrap")
    def _set_only(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        """Only the fields that are set: `JobSpec` leaves the whole section out when neither is."""
        return {k: v for k, v in handler(self).items() if v is not None}
