"""Fair share between teams, pure: Slurm's fair-share factor from decayed GPU-hours over team shares.

Each team has a weight (`share`, default 1; `vigil teams set-share TEAM W`). Its usage is the GPU-hours its
jobs' attempts held, each hour weighed down by half every `half_life_h` hours since (Slurm's
PriorityDecayHalfLife): `decayed_gpu_hours`. Among the teams taking part (those with usage, or with a job
waiting or running), shares and usages are normalised to sum to 1, and a team's fair-share factor is
`2 ** (-usage / share)` (Slurm's classic formula): 1 for a team that used nothing, 0.5 for one that used
exactly its share, towards 0 for one far over it. The queue orders jobs of equal priority by it, highest
first (`placement.queue_order`); quotas stay hard limits on top (`quotas`).

`Standing.over_share` says a team used more than its share; `borrowed` says how many of the devices a team
holds now are beyond its share of the cluster (what a preemption takes back first).

`UsageCache` keeps the usage read for a placement pass a few seconds (`USAGE_TTL_S`), so that passes under
a stream of events do not each read every attempt's history; a running attempt's use is open-ended, so a
kept answer still counts it up to each pass's own clock.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

Team = str | None  # None: jobs of users without a team, one group of their own
DEFAULT_SHARE = 1.0
# How long a placement pass reuses the usage read by an earlier one (seconds of the caller's clock). Usage
# decays over hours: a few seconds' staleness is the attempts that started or ended meanwhile.
USAGE_TTL_S = 5.0


@dataclass(frozen=True, slots=True)
class Use:
    """`devices` held by one of `team`'s attempts from `start` to `end` (seconds since the epoch; infinite
    while the attempt still holds them)."""

    team: Team
    devices: int
    start: float
    end: float


@dataclass(slots=True)
class UsageCache:
    """The uses read at one time, reused until `ttl_s` later. The clock is the caller's (a pass's `now`):
    a use still running has an infinite `end`, which `decayed_gpu_hours` counts up to each later `now`."""

    ttl_s: float = USAGE_TTL_S
    _uses: tuple[Use, ...] | None = None
    _read_at: float = 0.0

    def get(self, now: float) -> tuple[Use, ...] | None:
        """The uses kept, unless none are, they are `ttl_s` old, or `now` is before their reading."""
        if self._uses is None or not self._read_at <= now < self._read_at + self.ttl_s:
            return None
        return self._uses

    def put(self, now: float, uses: Iterable[Use]) -> tuple[Use, ...]:
        """Keep `uses`, read at `now`; returns them."""
        self._uses, self._read_at = tuple(uses), now
        return self._uses


@dataclass(frozen=True, slots=True)
class Standing:
    """A team's place in the fair share: its normalised share and usage (each 0..1 over the teams taking
    part) and its decayed GPU-hours."""

    team: Team
    share: float
    usage: float
    gpu_hours: float

    @property
    def ratio(self) -> float:
        """Usage over share: 1.4 is 40% over its share."""
        return self.usage / self.share

    @property
    def factor(self) -> float:
        """Slurm's fair-share factor, 2^(-usage/share): 1 (no usage) down towards 0."""
        return 2.0 ** (-self.ratio)

    @property
    def over_share(self) -> bool:
        return self.ratio > 1.0


def decayed_gpu_hours(uses: Iterable[Use], now: float, half_life_h: float) -> dict[Team, float]:
    """Each team's GPU-hours, an hour `a` hours ago counting `2 ** (-a / half_life_h)`; the part of a use
    after `now` does not count yet."""
    if half_life_h <= 0:
        raise ValueError(f"half_life_h must be > 0, got {half_life_h}")
    tau = half_life_h * 3600.0 / math.log(2)  # the decay's time constant, seconds
    out: dict[Team, float] = {}
    for use in uses:
        end = min(use.end, now)
        if end <= use.start or use.devices <= 0:
            continue
        # The integral of exp(-(now - t) / tau) over [start, end], in hours.
        weight = tau * (math.exp(-(now - end) / tau) - math.exp(-(now - use.start) / tau)) / 3600.0
        out[use.team] = out.get(use.team, 0.0) + use.devices * weight
    return out


def standings(
    shares: Mapping[str, float], gpu_hours: Mapping[Team, float], active: Iterable[Team] = ()
) -> dict[Team, Standing]:
    """Every team taking part (with usage, or `active`: a job waiting or running) and its standing.
    `shares`: the weights set per team (a team not listed has `DEFAULT_SHARE`)."""
    teams = {t for t, h in gpu_hours.items() if h > 0} | set(active)
    weight = {t: _share(shares, t) for t in teams}
    total_weight = sum(weight.values()) or 1.0
    total_hours = sum(gpu_hours.get(t, 0.0) for t in teams)
    return {
        t: Standing(
            team=t,
            share=weight[t] / total_weight,
            usage=gpu_hours.get(t, 0.0) / total_hours if total_hours > 0 else 0.0,
            gpu_hours=gpu_hours.get(t, 0.0),
        )
        for t in teams
    }


def factor(standing: Mapping[Team, Standing], team: Team) -> float:
    """The team's fair-share factor; 1 for a team not taking part (it used nothing)."""
    found = standing.get(team)
    return 1.0 if found is None else found.factor


def borrowed(
    held: Mapping[Team, int], shares: Mapping[str, float], capacity: int, waiting: Iterable[Team] = ()
) -> dict[Team, int]:
    """Devices each team holds beyond its share of `capacity` devices, the share normalised over the teams
    holding devices or `waiting` for them; teams within their share are left out. A team over its share
    borrowed these from the others: the first taken back when their jobs arrive (Kueue's borrowing)."""
    teams = {t for t, n in held.items() if n > 0} | set(waiting)
    total_weight = sum(_share(shares, t) for t in teams) or 1.0
    out = {}
    for team in teams:
        over = held.get(team, 0) - math.floor(capacity * _share(shares, team) / total_weight)
        if over > 0:
            out[team] = over
    return out


def check_share(share: float) -> float:
    """A team's share as given: ValueError naming the value unless it is a finite number > 0."""
    if (
        isinstance(share, bool)
        or not isinstance(share, int | float)
        or not math.isfinite(share)
        or share <= 0
    ):
        raise ValueError(f"share must be a number > 0 (a team's weight in the fair share), got {share!r}")
    return float(share)


def _share(shares: Mapping[str, float], team: Team) -> float:
    return shares.get(team, DEFAULT_SHARE) if team is not None else DEFAULT_SHARE
