"""GPU quotas per user and per team, pure: how many devices a user's (a team's) jobs may hold at once.

Every device a job is placed on counts (a CPU slot on a node without GPUs too). Two checks:

- `alone_exceeds`, at submit: a job that needs more than a quota allows could never run; the gateway
  refuses it (422, naming the quota).
- `Ledger`, at placement (`placement.plan`): a job that would take its owner or team past a quota,
  given the devices their other jobs hold, waits in the queue with the reason
  ("quota: team vision uses 6 of 8 GPUs; this job needs 4"), and does not hold up other users' jobs.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field


@dataclass(frozen=True, slots=True)
class Quotas:
    """Devices at once, per user name and per team name; a name not listed has no limit."""

    users: Mapping[str, int] = field(default_factory=dict)
    teams: Mapping[str, int] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class Holding:
    """The devices one job holds now."""

    job_id: str
    owner: str
    team: str | None
    devices: int


def alone_exceeds(owner: str, team: str | None, devices: int, quotas: Quotas) -> str | None:
    """Why a job of `devices` devices can never run under its owner's or team's quota; None if it can."""
    limit = quotas.users.get(owner)
    if limit is not None and devices > limit:
        return f"the job needs {devices} GPUs, more than user {owner}'s quota of {limit} GPUs at once"
    limit = quotas.teams.get(team) if team is not None else None
    if limit is not None and devices > limit:
        return f"the job needs {devices} GPUs, more than team {team}'s quota of {limit} GPUs at once"
    return None


class Ledger:
    """What each user and team holds during one placement pass. `refusal` says why a job must wait;
    `take` books a placed job's devices; `waiting` collects each refused job's reason."""

    def __init__(self, quotas: Quotas, held: Iterable[Holding] = ()) -> None:
        self.quotas = quotas
        self._held = {h.job_id: h for h in held}
        self.waiting: dict[str, str] = {}

    def _used(self, job_id: str, *, owner: str | None = None, team: str | None = None) -> int:
        """Devices held by jobs other than `job_id` (its own earlier attempt's devices are its to reuse)."""
        return sum(
            h.devices
            for h in self._held.values()
            if h.job_id != job_id and (h.owner == owner if owner is not None else h.team == team)
        )

    def refusal(self, job_id: str, owner: str | None, team: str | None, devices: int) -> str | None:
        """Why the job must wait for its owner's or team's other jobs to end; None when it may run."""
        if owner is not None and (limit := self.quotas.users.get(owner)) is not None:
            used = self._used(job_id, owner=owner)
            if used + devices > limit:
                return f"quota: user {owner} uses {used} of {limit} GPUs; this job needs {devices}"
        if team is not None and (limit := self.quotas.teams.get(team)) is not None:
            used = self._used(job_id, team=team)
            if used + devices > limit:
                return f"quota: team {team} uses {used} of {limit} GPUs; this job needs {devices}"
        return None

    def take(self, job_id: str, owner: str | None, team: str | None, devices: int) -> None:
        self._held[job_id] = Holding(job_id, owner or "", team, devices)
