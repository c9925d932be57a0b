"""The fleet bench's plan (`VIGIL_FLEET_*`: the sizes, the step rate, how long each) and what one
measured size holds (`Window`). See `vigil_bench.fleet`."""

from __future__ import annotations

import math
import os
import statistics
from dataclasses import dataclass
from typing import Any

from vigil_bench import percentile
from vigil_bench.fleet_probes import (
    Stages,
)
from vigil_bench.fleet_sim import DEVICES
from vigil_bench.fleet_watch import Watch

PROBE_EVERY_S = 1.0
IDLE_PROBES = 60
LAG_SAMPLE_S = 0.5
TOKEN = "bench-fleet-token-" + "x" * 16
AUTO = "auto"
STRESS_NODES = 256
BUSY_SLACK = 1.1  # "at most about" the busy share: the auto size comes from a fit of noisy figures
SIMULATOR_S = 24 * 3600.0  # a simulator runs until the bench stops it


@dataclass(frozen=True)
class Plan:
    # Nodes at each measured size, increasing; `auto` (last only): the most that keep `busy` of the cores
    # busy, by the line through the sizes before it (two at least).
    sizes: tuple[int | str, ...] = (16, 48, AUTO)
    step_hz: float = 1.0
    seconds: float = 60.0  # measured at each size
    busy: float = 0.6
    stress: bool = False  # and 256 nodes after the sizes, reported with no target
    telemetry: int = 1
    guardians: int = 2
    # Each node steps at its own phase of the period, in this many groups (1: every rank of the fleet
    # at the same instant, a burst no real fleet of independent jobs sends).
    phases: int = 16

    def __post_init__(self) -> None:
        fixed = [s for s in self.sizes if s != AUTO]
        where = f"VIGIL_BENCH_FLEET_SIZES={','.join(map(str, self.sizes))}"
        if any(not isinstance(s, int) or s < 1 for s in fixed):
            raise ValueError(f"{where}: each size is a number of nodes (1 or more) or '{AUTO}'")
        if AUTO in self.sizes[:-1]:
            raise ValueError(f"{where}: '{AUTO}' can only be the last size")
        if fixed != sorted(set(fixed)):
            raise ValueError(f"{where}: the sizes must increase (the fleet only grows)")
        if len(fixed) < 2:
            raise ValueError(f"{where}: two sizes at least are measured before a cost line can be drawn")
        if not 0 < self.busy <= 1:
            raise ValueError(f"VIGIL_BENCH_FLEET_BUSY={self.busy}: a share of the cores, in (0, 1]")

    @classmethod
    def from_env(cls) -> Plan:
        env = os.environ.get
        for gone, instead in (("NODES", "SIZES"), ("SIMULATORS", "SIZES (one simulator per size)")):
            if env(f"VIGIL_BENCH_FLEET_{gone}"):
                raise ValueError(f"VIGIL_BENCH_FLEET_{gone} is gone: set VIGIL_BENCH_FLEET_{instead}")
        raw = env("VIGIL_BENCH_FLEET_SIZES", ",".join(map(str, cls.sizes)))
        try:
            sizes = tuple(s if s == AUTO else int(s) for s in (p.strip() for p in raw.split(",")))
        except ValueError:
            raise ValueError(
                f"VIGIL_BENCH_FLEET_SIZES={raw}: comma-separated node counts, the last may be '{AUTO}'"
            ) from None
        stress = env("VIGIL_BENCH_FLEET_STRESS", "0")
        if stress not in ("0", "1"):
            raise ValueError(f"VIGIL_BENCH_FLEET_STRESS={stress}: 1 (also the 256-node stress run) or 0")
        return cls(
            sizes=sizes,
            step_hz=float(env("VIGIL_BENCH_FLEET_STEP_HZ", cls.step_hz)),
            seconds=float(env("VIGIL_BENCH_FLEET_SECONDS", cls.seconds)),
            busy=float(env("VIGIL_BENCH_FLEET_BUSY", cls.busy)),
            stress=stress == "1",
            telemetry=int(env("VIGIL_BENCH_FLEET_TELEMETRY", cls.telemetry)),
            guardians=int(env("VIGIL_BENCH_FLEET_GUARDIANS", cls.guardians)),
            phases=int(env("VIGIL_BENCH_FLEET_PHASES", cls.phases)),
        )


# --- one measured size ----------------------------------------------------------------------------------


@dataclass
class Window:
    """A stretch of `elapsed` seconds at `nodes` nodes: every process's CPU, the probes, the backlogs."""

    nodes: int
    step_hz: float
    elapsed: float
    cpu_s: dict[str, float]  # per process, over the window
    watch: Watch
    probes: list[float | None]
    stages: Stages
    stored: int  # step rows telemetry stored meanwhile
    db_bytes: int  # the database's growth meanwhile
    judged: dict[str, int]  # per guardian, the events it acknowledged meanwhile
    offered: dict[str, int]  # per guardian, the events its shares' consumers were offered meanwhile
    machine_busy: float  # every process on the machine, ours or not
    loadavg: list[float]  # at its end

    @property
    def ranks(self) -> int:
        return self.nodes * DEVICES

    @property
    def rate(self) -> float:
        return self.ranks * self.step_hz

    @property
    def cpu_per_s(self) -> dict[str, float]:
        return {k: v / self.elapsed for k, v in self.cpu_s.items()}

    def busy(self, cores: int) -> float:
        """The share of the machine's cores this run's processes kept busy (simulator and bench too)."""
        return sum(self.cpu_s.values()) / (self.elapsed * cores)

    @property
    def answered(self) -> list[float]:
        return [x for x in self.probes if x is not None]

    @property
    def p99(self) -> float:
        """Seconds; infinite when a probe got no answer."""
        ok = self.answered
        return percentile(ok, 0.99) if ok and len(ok) == len(self.probes) else math.inf

    def growing(self) -> list[str]:
        """The durable consumers whose backlog grew through the window: its last third over twice its
        first (`Watch.consumer`) and over one second of the fleet's step events."""
        return [
            name
            for name in self.watch.names()
            if (c := self.watch.consumer(name))["growing"] and c["last_third"] > self.rate
        ]

    @property
    def rate_held(self) -> bool:
        return self.stored >= 0.9 * self.rate * self.elapsed

    def summary(self, idle_p99: float, cores: int) -> dict[str, Any]:
        p99 = self.p99
        return {
            "nodes": self.nodes,
            "ranks": self.ranks,
            "seconds": round(self.elapsed, 1),
            "busy": round(self.busy(cores), 3),
            "machine_busy": round(self.machine_busy, 3),
            "cpu_per_s": {k: round(v, 4) for k, v in sorted(self.cpu_per_s.items())},
            "p50_ms": round(statistics.median(self.answered) * 1e3, 2) if self.answered else None,
            "p99_ms": round(p99 * 1e3, 2) if math.isfinite(p99) else None,
            "ratio": round(p99 / idle_p99, 2) if math.isfinite(p99) else None,
            "probes": len(self.probes),
            "probes_missed": len(self.probes) - len(self.answered),
            "backlog_growing": self.growing(),
            "target_step_events_per_s": self.rate,
            "stored_step_events_per_s": round(self.stored / self.elapsed, 1),
            "loadavg": self.loadavg,
            "stages": self.stages.summary(),
        }
