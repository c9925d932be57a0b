"""What each service of `vigil bench fleet` costs per thousand ranks, from its CPU at a few fleet sizes.

Pure: per-process CPU seconds per second at each measured size in, a straight line per service out
(`per_1000_ranks` and a `fixed` cost, so that what a service spends with no fleet is not taken for a
per-rank cost), the fleet size that keeps the machine's cores at a chosen share busy, and the cores
each service needs at larger fleets (extrapolated along the line, and said so).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

# The services a control plane sizes, in the order a table shows them; the simulator and the bench's
# own process (its probes and sampling) are reported apart: they are not Vigil.
SIZED = ("nats-server", "guardians", "telemetry", "postgres", "scheduler")
NOT_VIGIL = ("simulator", "bench")
SIZING_GPUS = (1_000, 10_000, 100_000)


@dataclass(frozen=True)
class Fit:
    """CPU seconds per second (cores) = `fixed` + `per_1000_ranks` x ranks / 1000, least squares."""

    per_1000_ranks: float
    fixed: float
    points: tuple[tuple[int, float], ...]  # (ranks, cores) as measured

    def at(self, ranks: float) -> float:
        return self.fixed + self.per_1000_ranks * ranks / 1000

    @property
    def worst_residual(self) -> float:
        """The largest distance of a measured point from the line, as a share of the largest point
        (0: a straight line through every point)."""
        top = max((abs(y) for _, y in self.points), default=0.0)
        if not top:
            return 0.0
        return max(abs(y - self.at(x)) for x, y in self.points) / top

    def summary(self) -> dict[str, Any]:
        return {
            "per_1000_ranks": round(self.per_1000_ranks, 4),
            "fixed": round(self.fixed, 4),
            "worst_residual": round(self.worst_residual, 3),
            "measured": {str(x): round(y, 4) for x, y in self.points},
        }


def fit(points: Iterable[tuple[int, float]]) -> Fit:
    """The least-squares line through (ranks, cores) at two or more distinct sizes."""
    pts = tuple(sorted(points))
    xs = [x for x, _ in pts]
    if len(set(xs)) < 2:
        raise ValueError(f"a cost line needs two or more distinct fleet sizes, got ranks {xs}")
    n = len(pts)
    mx, my = sum(xs) / n, sum(y for _, y in pts) / n
    slope = sum((x - mx) * (y - my) for x, y in pts) / sum((x - mx) ** 2 for x in xs)
    return Fit(per_1000_ranks=slope * 1000, fixed=my - slope * mx, points=pts)


def by_service(cpu_per_s: Mapping[str, float]) -> dict[str, float]:
    """Per-process cores grouped as they are sized: each guardian and their sum (`guardians`), the
    telemetry replicas summed, the simulator processes summed; nats-server, postgres, scheduler and
    the bench as they are."""
    out: dict[str, float] = {}
    for name, cores in cpu_per_s.items():
        group = name.rsplit("-", 1)[0] if name.startswith(("telemetry-", "simulator-")) else name
        out[group] = out.get(group, 0.0) + cores
        if name.startswith("guardian-"):
            out["guardians"] = out.get("guardians", 0.0) + cores
    return out


def costs(sizes: Sequence[tuple[int, Mapping[str, float]]]) -> dict[str, Fit]:
    """A line per service (`by_service`) and one for everything measured (`total`), from (ranks,
    per-process cores) at each size."""
    grouped = [(ranks, by_service(cpu)) for ranks, cpu in sizes]
    names = sorted({name for _, cpu in grouped for name in cpu})
    out = {name: fit((ranks, cpu.get(name, 0.0)) for ranks, cpu in grouped) for name in names}
    out["total"] = fit((ranks, sum(v for k, v in cpu.items() if k != "guardians")) for ranks, cpu in grouped)
    return out


def ranks_at_busy(total: Fit, cores: int, busy: float) -> int:
    """The ranks at which everything measured (`total`) keeps `busy` (0..1) of `cores` busy; 0 when its
    fixed cost alone is over that, and a very large number when the cost does not grow with ranks."""
    if not 0 < busy <= 1:
        raise ValueError(f"busy must be a share of the cores in (0, 1], got {busy}")
    room = busy * cores - total.fixed
    if room <= 0:
        return 0
    if total.per_1000_ranks <= 0:
        return 10**9
    return int(room / total.per_1000_ranks * 1000)


def sizing(fits: Mapping[str, Fit], gpus: Sequence[int] = SIZING_GPUS) -> dict[str, dict[str, Any]]:
    """Cores per sized service at each fleet of `gpus` (one rank per GPU, one step per second), each
    figure marked measured (inside the measured ranks) or extrapolated (along the line beyond them)."""
    out: dict[str, dict[str, Any]] = {}
    for name in SIZED:
        if name not in fits:
            continue
        f = fits[name]
        lo, hi = f.points[0][0], f.points[-1][0]
        out[name] = {
            str(n): {"cores": round(f.at(n), 2), "how": "measured" if lo <= n <= hi else "extrapolated"}
            for n in gpus
        }
    return out


def render(
    sizes: Sequence[Mapping[str, Any]], fits: Mapping[str, Fit], table: Mapping[str, Mapping[str, Any]]
) -> str:
    """The human tables: cores per service at each measured size, the lines, and the sizing."""
    names = [n for n in (*SIZED, *NOT_VIGIL) if n in fits]
    head = ["ranks", *names, "busy", "p99 ms", "ratio", "store p99 ms", "backlog growing"]
    lines = ["cores (CPU-s/s) per service at each size", "| " + " | ".join(head) + " |"]
    lines.append("|" + " --- |" * len(head))
    for s in sizes:
        cpu = by_service(s["cpu_per_s"])
        row = [str(s["ranks"]), *(f"{cpu.get(n, 0.0):.3f}" for n in names)]
        row += [f"{s['busy']:.0%}", str(s["p99_ms"]), str(s["ratio"])]
        row += [str(s.get("stages", {}).get("stored_p99_ms")), ", ".join(s["backlog_growing"]) or "-"]
        lines.append("| " + " | ".join(row) + " |")
    lines += ["", "per 1,000 ranks at 1 step/s (line: fixed + per 1,000 ranks; worst residual)"]
    lines += ["| service | per 1,000 ranks | fixed | worst residual |", "| --- | --- | --- | --- |"]
    for n in names:
        f = fits[n]
        lines.append(f"| {n} | {f.per_1000_ranks:.3f} | {f.fixed:.3f} | {f.worst_residual:.0%} |")
    gpus = sorted({g for row in table.values() for g in row}, key=int)
    lines += ["", "cores at 1 step/s (m: measured, e: extrapolated)"]
    lines += ["| service | " + " | ".join(f"{int(g):,} GPUs" for g in gpus) + " |"]
    lines.append("|" + " --- |" * (len(gpus) + 1))
    for n, row in table.items():
        cells = [f"{row[g]['cores']} {row[g]['how'][0]}" for g in gpus]
        lines.append(f"| {n} | " + " | ".join(cells) + " |")
    return "\n".join(lines)
