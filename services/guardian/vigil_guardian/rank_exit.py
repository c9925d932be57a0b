"""Rank exits: a rank that ended with a failure Vigil did not cause is an incident (an alert)."""

from __future__ import annotations

from vigil.events import RankExited
from vigil_guardian.verdict import Verdict


def rank_exit(event: RankExited) -> Verdict | None:
    """A verdict for a non-zero exit or a death by signal, unless Vigil ended the rank on purpose."""
    failed = event.failure != "ok" or event.exit_code not in (0, None)
    if not failed or event.failure == "killed_by_vigil":
        return None
    how = f"exit code {event.exit_code}" if event.exit_code is not None else f"signal {event.signal}"
    return Verdict(
        kind="rank_exit",
        step=event.last_step,
        rank=event.rank,
        node=event.node,
        message=f"rank {event.rank} on {event.node} exited: {event.failure} ({how})",
        evidence={
            "exit_code": event.exit_code,
            "signal": event.signal,
            "failure": event.failure,
            "last_step": event.last_step,
            "log_tail": event.log_tail[-2000:],
        },
    )
