"""The fleet bench's result: every measured size's figures, the auto size and the verdict, from the
windows (`fleet_plan.Window`). See `vigil_bench.fleet`."""

from __future__ import annotations

import contextlib
import json
import math
import statistics
import sys
import time
from collections.abc import Iterator
from typing import Any

from vigil_bench import percentile, result
from vigil_bench.fleet_costs import costs, ranks_at_busy, render, sizing
from vigil_bench.fleet_plan import BUSY_SLACK, Plan, Window
from vigil_bench.fleet_probes import (
    Stages,
)
from vigil_bench.fleet_sim import DEVICES
from vigil_bench.fleet_watch import holding_back, shares


class Took:
    """Each phase's wall time, printed to stderr as it ends."""

    def __init__(self) -> None:
        self.s: dict[str, float] = {}
        self.t0 = time.monotonic()

    @contextlib.contextmanager
    def __call__(self, phase: str) -> Iterator[None]:
        t0 = time.monotonic()
        try:
            yield
        finally:
            self.s[phase] = round(time.monotonic() - t0, 1)
            print(f"fleet: {phase}: {self.s[phase]} s", file=sys.stderr, flush=True)


def report(
    plan: Plan,
    cores: int,
    idle: list[float | None],
    idle_stages: Stages,
    idle_load: list[float],
    windows: list[Window],
    stress: Window | None,
    sim_stats: list[dict[str, Any]],
    drain_s: float | None,
    logs: dict[str, dict[str, int]],
    took: Took,
    failed: list[str],
) -> dict[str, Any]:
    ok_idle = [x for x in idle if x is not None]
    idle_p99 = percentile(ok_idle, 0.99) if ok_idle else math.nan
    fits = costs([(w.ranks, w.cpu_per_s) for w in windows])  # the stress run is not in the lines
    within = [w for w in windows if w.busy(cores) <= plan.busy * BUSY_SLACK]
    at = within[-1] if within else windows[0]  # the latency figure's size
    sizes = [w.summary(idle_p99, cores) for w in windows]
    table = sizing(fits)
    print(render(sizes, fits, table), flush=True)
    load_p99 = at.p99
    print(
        f"\nlatency at {at.ranks} ranks ({at.busy(cores):.0%} of {cores} cores busy by this run, "
        f"{at.machine_busy:.0%} by everything): p99 {load_p99 * 1e3:.1f} ms vs {idle_p99 * 1e3:.1f} ms "
        f"idle, ratio {load_p99 / idle_p99:.2f}; backlog growing: {', '.join(at.growing()) or 'none'}",
        flush=True,
    )
    stress_out = None
    if stress is not None:
        # and what the lines through the sizes said it would cost: how far they hold beyond them
        predicted = fits["total"].at(stress.ranks) / cores
        stress_out = {
            **stress.summary(idle_p99, cores),
            "busy_by_the_lines": round(predicted, 3),
            "target": None,
        }
        print(f"stress (no target): {json.dumps(stress_out)}", flush=True)
    took_s = {**took.s, "total": round(time.monotonic() - took.t0, 1)}
    print("took: " + ", ".join(f"{k} {v} s" for k, v in took_s.items()), flush=True)

    tele = at.watch.consumer("telemetry-steps")
    growing = at.growing()
    ok = (
        load_p99 <= 3 * idle_p99 and not growing and at.rate_held and at.busy(cores) <= plan.busy * BUSY_SLACK
    )

    held_back = holding_back(
        plan.step_hz, at.watch, at.cpu_s, at.elapsed, sim_stats, logs,
        len(at.probes) - len(at.answered), load_p99 / idle_p99, at.machine_busy,
    )  # fmt: skip
    store_p99 = percentile(at.stages.stored, 0.99) if at.stages.stored else 0.0
    if store_p99 > 0.1:
        held_back.insert(
            0,
            f"VIGIL_JOBS: a step's publish acknowledged p99 {store_p99 * 1e3:.0f} ms (an fsync per message): "
            "the stream is not keeping up",
        )
    held_back[:0] = [f"not measured: {f}" for f in failed]
    if not within:
        held_back.insert(
            0,
            f"no size kept {plan.busy:.0%} of the {cores} cores busy or less: the smallest, {at.ranks} "
            f"ranks, kept {at.busy(cores):.0%}",
        )

    def cost(name: str) -> dict[str, Any] | None:
        return fits[name].summary() if name in fits else None

    return result(
        "fleet",
        value=load_p99 * 1e3,
        floor=idle_p99 * 1e3,
        unit="ms, guardian p99 NaN step published -> HaltJob received, at the sustainable load (floor: idle)",
        target=f"ratio <= 3 and no backlog growing at the largest size keeping <= {plan.busy:.0%} of the "
        "cores busy (every process of the run counted), the step rate held",
        ok=bool(ok),
        nodes=at.nodes,
        ranks=at.ranks,
        ranks_per_node=DEVICES,
        step_hz=plan.step_hz,
        seconds=round(at.elapsed, 1),
        busy=round(at.busy(cores), 3),
        busy_target=plan.busy,
        machine_busy=round(at.machine_busy, 3),
        sustainable_ranks=ranks_at_busy(fits["total"], cores, plan.busy),
        backlog_growing=growing,
        sizes=sizes,
        costs={
            name: fits[name].summary() for name in sorted(fits) if name not in ("simulator", "bench", "total")
        },
        simulator_cost=cost("simulator"),
        bench_cost=cost("bench"),
        total_cost=cost("total"),
        sizing=table,
        sizing_note="cores = fixed + per_1000_ranks x GPUs / 1000, one rank per GPU at the step rate, "
        "along the line through the measured sizes: 'measured' inside their ranks, 'extrapolated' beyond",
        stress=stress_out,
        grow_failed=failed,
        telemetry_replicas=plan.telemetry,
        guardians=plan.guardians,
        events_per_s_by_guardian={who: round(n / at.elapsed, 1) for who, n in at.judged.items()},
        offered_per_s_by_guardian={who: round(n / at.elapsed, 1) for who, n in at.offered.items()},
        phases=plan.phases,
        target_step_events_per_s=at.rate,
        published_step_events=sum(s.get("step", 0) for s in sim_stats),  # the simulators' whole run
        stored_step_events_per_s=round(at.stored / at.elapsed, 1),
        telemetry_backlog_first_third=tele["first_third"],
        telemetry_backlog_last_third=tele["last_third"],
        telemetry_backlog_max=tele["max"],
        telemetry_lag_s_max=round(tele["max"] / at.rate, 2),
        guardian_backlog_max=sum(
            at.watch.consumer(c)["max"] for c in at.watch.names() if c.startswith("guardian")
        ),
        lag_growing="telemetry-steps" in growing,
        telemetry_drain_after_s=round(drain_s, 2) if drain_s is not None else None,
        stages_idle=idle_stages.summary(),
        stages_load=at.stages.summary(),
        guardian_idle_p50_ms=round(statistics.median(ok_idle) * 1e3, 2) if ok_idle else None,
        guardian_load_p50_ms=round(statistics.median(at.answered) * 1e3, 2) if at.answered else None,
        probes_idle=len(idle),
        probes_load=len(at.probes),
        probes_load_missed=len(at.probes) - len(at.answered),
        pg_mb_per_million_steps=round(at.db_bytes / max(at.stored, 1) * 1e6 / 2**20, 1),
        cpu_s_under_load={k: round(v, 1) for k, v in at.cpu_s.items()},
        cpu_core_share=shares(at.cpu_s, at.elapsed),
        consumers={c: at.watch.consumer(c) for c in at.watch.names()},
        holding_back=held_back,
        logs=logs,
        timeline=at.watch.timeline(),
        simulators=sim_stats,
        loadavg_idle=idle_load,
        loadavg_load_end=at.loadavg,
        cores=cores,
        took_s=took_s,
    )
