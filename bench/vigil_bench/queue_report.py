"""The figures of `vigil bench queue`, pure over what the simulated cluster recorded (`queue_sim.Record`), and
their table, targets and PNG.

Per policy: GPU utilization over the arrivals' window (GPU-seconds in use over the capacity's); each job's
wait (submitted to its first rank start, trace minutes; a job that never started counts its wait until the
run's end, and is counted in `never_started`); the mean and p95 wait per size class; each team's share of
the GPU-hours in the window against its weight, and Jain's index over usage/weight (1: every team got
exactly its weight); preemptions and the steps they lost.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from vigil_bench import percentile
from vigil_bench.queue_sim import Record
from vigil_bench.queue_trace import TEAMS, largest_job, size_class

CLASSES = ("1-8", "9-32", "33-64")


@dataclass(frozen=True, slots=True)
class Outcome:
    """One policy's run: its records, the window of arrivals (seconds from the start), when the run ended, the
    capacity in GPUs and the real seconds a trace minute took."""

    policy: str
    records: list[Record]
    window_s: float
    ended_s: float
    capacity: int
    seconds_per_minute: float


def _overlap(start: float, end: float, lo: float, hi: float) -> float:
    return max(0.0, min(end, hi) - max(start, lo))


def utilization(out: Outcome) -> float:
    used = sum(g * _overlap(s, e, 0.0, out.window_s) for r in out.records for s, e, g in r.runs)
    return used / (out.capacity * out.window_s)


def wait_minutes(out: Outcome, record: Record) -> float:
    assert record.submitted is not None
    start = record.first_start if record.first_start is not None else out.ended_s
    return max(0.0, start - record.submitted) / out.seconds_per_minute


def jain(values: Iterable[float]) -> float:
    """Jain's fairness index: (sum x)^2 / (n sum x^2), 1 when all are equal, 1/n when one has everything."""
    xs = list(values)
    squares = sum(x * x for x in xs)
    return sum(xs) ** 2 / (len(xs) * squares) if squares else 1.0


def figures(out: Outcome) -> dict[str, Any]:
    """One policy's figures."""
    submitted = [r for r in out.records if r.submitted is not None]
    waits: dict[str, list[float]] = {c: [] for c in CLASSES}
    for r in submitted:
        waits[size_class(r.job.gpus)].append(wait_minutes(out, r))
    by_class = {
        c: {
            "jobs": len(w),
            "mean_wait_min": round(sum(w) / len(w), 2) if w else None,
            "p95_wait_min": round(percentile(w, 0.95), 2) if w else None,
        }
        for c, w in waits.items()
    }
    hours = {t.name: 0.0 for t in TEAMS}
    for r in submitted:
        hours[r.job.team.name] += sum(g * _overlap(s, e, 0.0, out.window_s) for s, e, g in r.runs) / 3600
    total_hours, total_share = sum(hours.values()) or 1.0, sum(t.share for t in TEAMS)
    teams = {
        t.name: {
            "weight": round(t.share / total_share, 3),
            "gpu_hours_share": round(hours[t.name] / total_hours, 3),
            "usage_over_weight": round((hours[t.name] / total_hours) / (t.share / total_share), 3),
        }
        for t in TEAMS
    }
    largest = largest_job([r.job for r in submitted], out.window_s / out.seconds_per_minute)
    largest_record = next(r for r in submitted if r.job is largest)
    return {
        "utilization": round(utilization(out), 4),
        "waits": by_class,
        "largest_job": {"gpus": largest.gpus, "wait_min": round(wait_minutes(out, largest_record), 2)},
        "teams": teams,
        "fairness": round(jain(v["usage_over_weight"] for v in teams.values()), 4),
        "preemptions": sum(r.preemptions for r in submitted),
        "steps_lost": sum(r.steps_lost for r in submitted),
        "time_limit_stops": sum(r.time_limit_stops for r in submitted),
        "jobs": len(submitted),
        "finished": sum(r.finished is not None for r in submitted),
        "never_started": sum(r.first_start is None for r in submitted),
    }


def _ratio(a: float | None, b: float | None) -> float | None:
    if a is None or b is None:
        return None
    return round(a / b, 4) if b else (1.0 if a == 0 else float("inf"))


def targets(fair: dict[str, Any], strict: dict[str, Any]) -> list[tuple[str, Any, str, bool]]:
    """Each target: its name, the figure, the floor or reference it is held against (same run), met."""
    small = _ratio(fair["waits"]["1-8"]["p95_wait_min"], strict["waits"]["1-8"]["p95_wait_min"])
    largest = _ratio(fair["largest_job"]["wait_min"], strict["largest_job"]["wait_min"])
    u, us = fair["utilization"], strict["utilization"]
    return [
        ("utilization >= strict + 10 points", u, f"strict {us}, floor {us + 0.10:.4f}", u >= us + 0.10),
        ("small p95 wait <= 0.5x strict", small, f"strict {strict['waits']['1-8']['p95_wait_min']} min",
         small is not None and small <= 0.5),
        ("largest job's wait <= 1.2x strict", largest, f"strict {strict['largest_job']['wait_min']} min",
         largest is not None and largest <= 1.2),
        ("fairness (Jain, usage/weight) >= 0.9", fair["fairness"], f"strict {strict['fairness']}",
         fair["fairness"] >= 0.9),
        ("0 steps lost to preemption", fair["steps_lost"], f"{fair['preemptions']} preemptions",
         fair["steps_lost"] == 0),
    ]  # fmt: skip


def print_table(
    fair: dict[str, Any], strict: dict[str, Any], checks: list[tuple[str, Any, str, bool]]
) -> None:
    rows = [("utilization", fair["utilization"], strict["utilization"])]
    for c in CLASSES:
        for key in ("mean_wait_min", "p95_wait_min"):
            rows.append((f"{c} GPUs {key}", fair["waits"][c][key], strict["waits"][c][key]))
        rows.append((f"{c} GPUs jobs", fair["waits"][c]["jobs"], strict["waits"][c]["jobs"]))
    largest = f"largest job ({fair['largest_job']['gpus']} GPUs) wait_min"
    rows.append((largest, fair["largest_job"]["wait_min"], strict["largest_job"]["wait_min"]))
    for team in fair["teams"]:
        f, s = fair["teams"][team], strict["teams"][team]
        rows.append(
            (f"{team} GPU-h share (weight {f['weight']})", f["gpu_hours_share"], s["gpu_hours_share"])
        )
    for key in ("fairness", "preemptions", "steps_lost", "time_limit_stops", "finished", "never_started"):
        rows.append((key, fair[key], strict[key]))
    print(f"{'figure':<40} {'fair':>10} {'strict':>10}")
    for name, a, b in rows:
        print(f"{name:<40} {a!s:>10} {b!s:>10}")
    for name, value, against, met in checks:
        print(f"target {name}: {value} ({against}): {'met' if met else 'not met'}")


def in_use(out: Outcome, step_s: float) -> tuple[list[float], list[int]]:
    """GPUs in use over time, sampled every `step_s` seconds: (trace minutes, GPUs)."""
    times, used = [], []
    t = 0.0
    runs = [run for r in out.records for run in r.runs]
    while t <= out.ended_s:
        times.append(t / out.seconds_per_minute)
        used.append(sum(g for s, e, g in runs if s <= t < e))
        t += step_s
    return times, used


def plot(path: Path, outcomes: list[Outcome], title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    path.parent.mkdir(parents=True, exist_ok=True)
    fig, ax = plt.subplots(figsize=(11, 4.5), dpi=110)
    for out in outcomes:
        times, used = in_use(out, out.seconds_per_minute / 4)
        ax.step(times, used, where="post", label=f"{out.policy} ({utilization(out):.0%} in the window)")
    window = outcomes[0].window_s / outcomes[0].seconds_per_minute
    ax.axhline(outcomes[0].capacity, color="k", linestyle="--", linewidth=0.8, label="capacity")
    ax.axvline(window, color="grey", linestyle=":", label="last arrival")
    ax.set(xlabel="trace minutes", ylabel="GPUs in use", title=title)
    ax.legend(loc="lower right")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
