"""The synthetic job trace of `vigil bench queue`, shaped like the published cluster traces (Microsoft Philly,
SenseTime Helios): most jobs take 1-8 GPUs and a few take 16-64; durations are log-normal (a heavy tail:
a median of minutes, some jobs for hours); users ask for time limits a few times longer than their jobs
run; arrivals are Poisson with bursts (a few periods at several times the rate); three teams with their
own shares, priorities and loads. Seeded: the same seed gives the same trace.

Times are trace minutes; the bench runs a trace minute in `TraceShape.seconds_per_minute` real seconds.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

# GPUs a job asks for, and how often (Philly: about half the jobs take one GPU, a few percent 32 or more)
SIZES: tuple[tuple[int, float], ...] = (
    (1, 0.32),
    (2, 0.14),
    (4, 0.14),
    (8, 0.22),
    (16, 0.08),
    (32, 0.06),
    (64, 0.04),
)


@dataclass(frozen=True, slots=True)
class Team:
    name: str
    share: float  # its fair-share weight
    priority: int
    load: float  # its part of the arrivals


# "prod" submits urgent work at a higher priority (it preempts); "research" and "interns" share the rest
TEAMS: tuple[Team, ...] = (
    Team("research", share=2.0, priority=10, load=0.5),
    Team("prod", share=1.0, priority=20, load=0.2),
    Team("interns", share=1.0, priority=10, load=0.3),
)


@dataclass(frozen=True, slots=True)
class TraceJob:
    index: int
    arrival: float  # trace minutes from the start
    gpus: int
    duration: float  # trace minutes it runs
    limit: float  # its time limit, trace minutes (>= duration)
    team: Team

    @property
    def size_class(self) -> str:
        return size_class(self.gpus)


def size_class(gpus: int) -> str:
    """The report's size classes: 1-8 GPUs (small), 9-32 (medium), 33-64 (large)."""
    return "1-8" if gpus <= 8 else "9-32" if gpus <= 32 else "33-64"


@dataclass(frozen=True, slots=True)
class TraceShape:
    minutes: float = 120.0  # arrivals span this long
    load: float = 1.1  # offered GPU-minutes over the cluster's capacity during the arrivals
    capacity: int = 512  # GPUs
    median_minutes: float = 6.0  # durations: log-normal with this median ...
    sigma: float = 1.0  # ... and this log-space spread (mean = median * e^(sigma^2 / 2))
    max_minutes: float = 60.0  # the tail cut here (the bench must end)
    bursts: int = 4  # periods of `burst_rate` times the rate ...
    burst_minutes: float = 4.0  # ... each this long
    burst_rate: float = 4.0
    seed: int = 0


def sizes(capacity: int) -> tuple[tuple[int, float], ...]:
    """`SIZES` up to the cluster's capacity, their probabilities renormalised."""
    kept = [(g, p) for g, p in SIZES if g <= capacity]
    total = sum(p for _, p in kept)
    return tuple((g, p / total) for g, p in kept)


def _size(rng: random.Random, table: tuple[tuple[int, float], ...]) -> int:
    x, acc = rng.random(), 0.0
    for gpus, p in table:
        acc += p
        if x < acc:
            return gpus
    return table[-1][0]


def trace(shape: TraceShape) -> list[TraceJob]:
    """The jobs of one trace in arrival order; a job of the largest size that fits the cluster always arrives
    after a quarter of the trace (the report's "largest job")."""
    rng = random.Random(shape.seed)
    table = sizes(shape.capacity)
    mean_gpus = sum(g * p for g, p in table)
    mean_minutes = shape.median_minutes * math.exp(shape.sigma**2 / 2)  # before the cut, near enough
    # the base rate such that base time plus bursts offer `load` of the capacity
    weighted_minutes = shape.minutes + shape.bursts * shape.burst_minutes * (shape.burst_rate - 1)
    rate = shape.load * shape.capacity * shape.minutes / (mean_gpus * mean_minutes * weighted_minutes)
    starts = sorted(rng.uniform(0, shape.minutes - shape.burst_minutes) for _ in range(shape.bursts))
    jobs: list[TraceJob] = []
    t = 0.0
    while True:
        bursting = any(s <= t < s + shape.burst_minutes for s in starts)
        t += rng.expovariate(rate * (shape.burst_rate if bursting else 1.0))
        if t >= shape.minutes:
            break
        gpus = _size(rng, table)
        duration = min(shape.max_minutes, rng.lognormvariate(math.log(shape.median_minutes), shape.sigma))
        duration = max(1.0, duration)
        limit = duration * rng.uniform(1.3, 3.0)  # users ask for more than they need
        team = rng.choices(TEAMS, weights=[team.load for team in TEAMS])[0]
        jobs.append(TraceJob(len(jobs), t, gpus, duration, limit, team))
    largest = table[-1][0]
    if not any(j.gpus == largest and j.arrival >= shape.minutes / 4 for j in jobs):
        # a short trace: one large job a quarter of the way in, once the cluster is busy
        at = next(i for i, j in enumerate(jobs) if j.arrival >= shape.minutes / 4)
        jobs[at] = TraceJob(at, jobs[at].arrival, largest, jobs[at].duration, jobs[at].limit, jobs[at].team)
    return jobs


def largest_job(jobs: list[TraceJob], minutes: float) -> TraceJob:
    """The report's largest job: the first of the largest size to arrive after a quarter of the trace's
    `minutes` (one that arrives on an empty cluster says nothing about the policy)."""
    most = max(j.gpus for j in jobs)
    return next(j for j in jobs if j.gpus == most and j.arrival >= minutes / 4)
