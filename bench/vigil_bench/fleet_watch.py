"""What `vigil bench fleet` samples through a measured window (every durable's backlog, every process's
CPU) and what it says holds a run back."""

from __future__ import annotations

import os
import statistics
import time
from dataclasses import dataclass, field
from typing import Any

from nats.js.api import ConsumerInfo

from vigil_bench.fleet_probes import backlog as _backlog


@dataclass
class Watch:
    """Every durable consumer's backlog (pending + unacknowledged) and every process's CPU seconds,
    sampled through the run."""

    t0: float
    cpu0: dict[str, float]
    samples: list[tuple[float, dict[str, int], dict[str, float]]] = field(default_factory=list)

    def sample(self, consumers: list[ConsumerInfo], cpu: dict[str, float]) -> None:
        self.samples.append((time.monotonic() - self.t0, {c.name: _backlog(c) for c in consumers}, cpu))

    def names(self) -> list[str]:
        return sorted({name for _, backlogs, _ in self.samples for name in backlogs})

    def consumer(self, name: str) -> dict[str, Any]:
        """Its backlog's max and its mean over the run's first and last thirds; growing when the last
        is over twice the first and over 100 messages."""
        backlog = [b.get(name, 0) for _, b, _ in self.samples] or [0]
        third = max(1, len(backlog) // 3)
        first, last = statistics.mean(backlog[:third]), statistics.mean(backlog[-third:])
        return {
            "max": max(backlog),
            "min": min(backlog),  # over 0: never caught up in the whole run
            "first_third": round(first),
            "last_third": round(last),
            "growing": last > max(2 * first, 100),
        }

    def timeline(self, every_s: float = 10.0) -> list[dict[str, Any]]:
        """About every `every_s`: the backlogs that are not empty, and each process's share of one core
        since the previous point."""
        out: list[dict[str, Any]] = []
        last_t, last_cpu = 0.0, self.cpu0
        for t, backlogs, cpu in self.samples:
            if t - last_t < every_s and (t, backlogs, cpu) != self.samples[-1]:
                continue
            span = max(t - last_t, 1e-9)
            out.append({
                "t": round(t, 1),
                "backlog": {k: v for k, v in backlogs.items() if v},
                "cpu": {k: round((v - last_cpu.get(k, 0.0)) / span, 2) for k, v in cpu.items()},
            })  # fmt: skip
            last_t, last_cpu = t, cpu
        return out


def shares(cpu_s: dict[str, float], elapsed: float) -> dict[str, float]:
    """CPU seconds as a share of one core over the run (1.0: a process that had a core to itself)."""
    return {k: round(v / elapsed, 2) for k, v in sorted(cpu_s.items(), key=lambda kv: -kv[1])}


def holding_back(
    step_hz: float,
    watch: Watch,
    cpu_s: dict[str, float],
    elapsed: float,
    sims: list[dict[str, Any]],
    logs: dict[str, dict[str, int]],
    probes_missed: int,
    probe_ratio: float,
    machine_busy: float = 0.0,
) -> list[str]:
    """What kept the run from its target, most telling first: the machine's cores, a process pegged at
    one core (a Python service uses one), consumers falling behind, a load generator late on its
    ticks, messages dropped by a slow subscriber, probes with no answer. `machine_busy`: the share of
    the cores busy whoever used them (this run's processes or others on a shared machine)."""
    found = []
    cores = os.cpu_count() or 1
    busy = sum(cpu_s.values()) / (elapsed * cores)
    if max(busy, machine_busy) >= 0.85:
        found.append(
            f"the machine: {max(busy, machine_busy):.0%} of its {cores} cores busy, "
            f"{busy:.0%} by this run's processes"
        )
    for name, share in shares(cpu_s, elapsed).items():
        if share >= 0.8 and name not in ("postgres", "nats-server"):  # those use several threads/processes
            found.append(f"{name}: {share:.0%} of a core (one Python process gets at most one)")
    for name in watch.names():
        c = watch.consumer(name)
        if c["growing"]:
            found.append(f"{name}: backlog growing, {c['first_third']} -> {c['last_third']} (max {c['max']})")
        elif c["min"] > 100:  # a steady flow always leaves a batch pending; more never caught up
            found.append(f"{name}: never caught up, backlog {c['min']} to {c['max']}")
    for i, sim in enumerate(sims):
        if sim.get("p99_late_s", 0.0) > 0.5 / step_hz:
            found.append(f"simulator-{i}: its ticks p99 {sim['p99_late_s']} s late (the generator is slow)")
    for name, counts in logs.items():
        if counts["slow_consumer"]:
            found.append(f"{name}: {counts['slow_consumer']} slow-consumer drops in its log")
    if probes_missed:
        found.append(f"guardian: {probes_missed} probes under load got no HaltJob within 30 s")
    if probe_ratio > 3:
        backlog = max(
            (watch.consumer(n)["max"] for n in watch.names() if n.startswith("guardian")), default=0
        )
        each = {n: f"{v / elapsed:.0%}" for n, v in cpu_s.items() if n.startswith("guardian")}
        found.append(
            f"guardian: detect-to-command p99 {probe_ratio:.0f}x idle; "
            f"its share consumers' backlog max {backlog}; of a core each: {each}"
        )
    return found
