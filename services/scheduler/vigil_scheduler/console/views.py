"""Pure shaping for the console's pages: the job page's header and tables, downsampled curves, the step
trace's bars, the GPU grid's colours, the NVLink graph's layout and the job states' colours. No I/O:
the pages feed them rows from the read model."""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from typing import Any

from vigil.jobstates import TERMINAL_STATES, JobState
from vigil_common.readmodel import shown_width
from vigil_common.step_columns import SERIES_METRICS

DEFAULT_POINTS = 1000
MAX_POINTS = 2000

# Each job state's badge colour: the stylesheet's `.state.<STATE>` rules are made from this (one per
# JobState member; a test checks that every state has one), so no template or CSS file spells a state.
STATE_COLOURS: dict[JobState, str] = {
    JobState.PENDING: "#777",
    JobState.SCHEDULED: "#5d6d7e",
    JobState.RUNNING: "#2471a3",
    JobState.HALTED: "#d68910",
    JobState.ROLLING_BACK: "#d68910",
    JobState.SUCCEEDED: "#1e8449",
    JobState.FAILED: "#c0392b",
    JobState.CANCELLED: "#566573",
}


def states_css() -> str:
    """The job states' badge rules (served as /console/states.css)."""
    return "".join(f".state.{state.value} {{ background: {STATE_COLOURS[state]}; }}\n" for state in JobState)


def job_header(job: dict[str, Any]) -> dict[str, Any]:
    """What the job page's header shows, as text, from `queries.job_detail`; `finished` (a state no
    transition leaves) hides the cancel button."""
    steps = job["spec"]["train"]["steps"]
    last = job["last_step"]
    return {
        "id": job["id"],
        "state": job["state"],
        "finished": job["state"] in TERMINAL_STATES,
        "attempt": job["attempt"],
        "priority": job["priority"],
        "last_step": last,
        "steps": steps,
        "loss": _number(job["loss"], "{:.4f}"),
        "reason": job["reason"] or "",
    }


def attempt_rows(job: dict[str, Any]) -> list[dict[str, Any]]:
    """The attempts table: when each attempt was launched, where its ranks ran, what it resumed from, the
    code package it ran (its hash) and what ended it (the current one of a job still going: "running")."""
    running = job["state"] not in TERMINAL_STATES
    return [
        {
            "attempt": a["attempt"],
            "launched_at": a["launched_at"],
            "placement": ", ".join(f"rank {p['rank']}@{p['node']}" for p in a["placement"]),
            "resume_from": a["resume_from"] or "start",
            "ended": a["ended"] or ("running" if running and a["attempt"] == job["attempt"] else ""),
            "code": a.get("code") or "",  # the SHA-256 of the code package it ran
        }
        for a in job["attempts"]
    ]


def checkpoint_rows(checkpoints: Iterable[dict[str, Any]]) -> list[dict[str, Any]]:
    return [
        {
            "step": c["step"],
            "valid": c["valid"],
            "size": f"{c['bytes'] / 1048576:.1f} MiB",
            "attempt": c["attempt"],
            "path": c["path"],
            "created_at": c["created_at"],
        }
        for c in checkpoints
    ]


def incident_rows(incidents: Iterable[dict[str, Any]]) -> list[dict[str, Any]]:
    keep = ("id", "occurred_at", "kind", "action", "step", "rank", "node", "message", "evidence")
    return [{**{k: i[k] for k in keep}, "stacks": stack_groups(i["evidence"])} for i in incidents]


def stack_groups(evidence: Any) -> list[str]:
    """A hang's stacks as the console lists them, a line per group of ranks that share a call path (the
    guardian's `stacks` evidence): `rank 3 (outlier): in Loader.__next__ (data.py:88)`, `ranks 0, 1, 2:
    wait in all_reduce (distributed_c10d.py:2501)`; none for other incidents."""
    stacks = evidence.get("stacks") if isinstance(evidence, dict) else None
    if not isinstance(stacks, dict):
        return []
    if stacks.get("error"):
        return [f"no stacks: {stacks['error']}"]
    outlier, lines = stacks.get("outlier"), []
    for g in stacks.get("groups") or []:
        ranks = g.get("ranks") or []
        who = ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(str(r) for r in ranks[:16])
        who += ", ..." if len(ranks) > 16 else ""
        where = f"wait in {g.get('frame')}" if g.get("collective") else f"in {g.get('frame')}"
        lines.append(f"{who}{' (outlier)' if ranks == outlier else ''}: {where}")
    if stacks.get("more_groups"):
        lines.append(f"{stacks['more_groups']} more groups (see the evidence)")
    lines += [f"rank {r}: no stacks ({why})" for r, why in (stacks.get("missing") or {}).items()]
    return lines


def _number(value: float | None, fmt: str) -> str:
    if value is None:
        return "-"
    return fmt.format(value) if math.isfinite(value) else str(value)  # nan, inf


PHASES = (  # (name, stored column): the trainer's phases in the order a step runs them
    ("data", "data_time_s"),
    ("forward", "forward_time_s"),
    ("backward", "backward_time_s"),
    ("comm", "comm_time_s"),
    ("optimizer", "optimizer_time_s"),
)


RANK_POINTS_BUDGET = 32_000  # points per metric over every rank's curve: 64 ranks get 500 each


def bucket_width(total_steps: int, points: int = DEFAULT_POINTS, ranks: int = 1) -> int:
    """Steps per bucket so that a curve of `total_steps` has at most `points` points (and at least half
    as many), fewer for a job with many ranks (each rank's curve is shipped): a width the stored
    buckets serve (`readmodel.shown_width`)."""
    points = max(1, min(points, MAX_POINTS, max(100, RANK_POINTS_BUDGET // max(ranks, 1))))
    return shown_width(max(1, math.ceil(max(total_steps, 1) / points)))


def series(
    rows: Iterable[Mapping[str, Any]], bucket: int, abandoned: Iterable[Mapping[str, Any]] = ()
) -> dict[str, Any]:
    """uPlot-ready columns from `readmodel.step_buckets` rows, and `readmodel.abandoned_buckets` rows
    (the runs of steps an in-place rollback abandoned, drawn apart and faded, as W&B draws a fork).

    `x` holds each bucket's first step; per metric, `ranks` has one column per rank (the rank's mean
    over the bucket's last runs, None where it has none), `mean` the mean over ranks (the sum for
    tokens/s), `abandoned` the same over the abandoned runs (None where a bucket has none), `lo`/`hi`
    the min and max of every finite value in the bucket over all ranks and runs (the band that keeps a
    spike visible however many steps a point stands for, a rolled-back one included), and `bad` the
    steps of buckets that held a NaN or Inf. (64 ranks x 500 points are 32,000 rows: one pass per
    metric, no call per row.)
    """
    rows = list(rows)
    abandoned = list(abandoned)
    buckets = sorted({r["bucket"] for r in rows})
    ranks = sorted({r["rank"] for r in rows})
    at = {b: i for i, b in enumerate(buckets)}
    col = {rank: i for i, rank in enumerate(ranks)}
    n = len(buckets)
    x = [b * bucket for b in buckets]  # a bucket's first step (width 1: the step itself)
    where = [(col[r["rank"]], at[r["bucket"]]) for r in rows]
    rows_n = {w: r for w, r in zip(where, rows, strict=True)} if abandoned else {}
    metrics: dict[str, Any] = {}
    for m in SERIES_METRICS:
        per_rank: list[list[float | None]] = [[None] * n for _ in ranks]
        lo: list[float | None] = [None] * n
        hi: list[float | None] = [None] * n
        bad: set[int] = set()
        m_lo, m_hi, m_bad = f"{m}_lo", f"{m}_hi", f"{m}_bad"
        for (c, i), r in zip(where, rows, strict=True):
            per_rank[c][i] = r[m]
            low = r[m_lo]
            if low is not None:
                if lo[i] is None or low < lo[i]:  # type: ignore[operator]
                    lo[i] = low
                high = r[m_hi]
                if hi[i] is None or high > hi[i]:  # type: ignore[operator]
                    hi[i] = high
            if r[m_bad]:
                bad.add(x[i])
        left: list[list[float | None]] = [[None] * n for _ in ranks]
        m_n, m_sum = f"{m}_n", f"{m}_sum"
        for a in abandoned:  # the stored bucket holds both runs: take the abandoned one out of it
            c, i = col.get(a["rank"]), at.get(a["bucket"])
            stored = rows_n.get((c, i))
            if c is None or i is None or stored is None or not a[m_n]:
                continue
            left[c][i] = a[m_sum] / a[m_n]
            total, count = per_rank[c][i], stored[m_n]
            kept = count - a[m_n]
            per_rank[c][i] = (total * count - a[m_sum]) / kept if total is not None and kept > 0 else None
        combine = _sum if m == "tokens_per_s" else _mean  # a job's throughput is its ranks' sum
        mean = [combine(values) for values in zip(*per_rank, strict=True)]
        gone = [combine(values) for values in zip(*left, strict=True)]
        metrics[m] = {
            "ranks": per_rank,
            "mean": mean,
            "abandoned": gone,
            "lo": lo,
            "hi": hi,
            "bad": sorted(bad),
        }
    last = max((r["last_step"] for r in rows), default=None)
    return {"bucket": bucket, "x": x, "ranks": ranks, "last_step": last, "metrics": metrics}


def _sum(values: Iterable[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return sum(present) if present else None


def _mean(values: Iterable[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return sum(present) / len(present) if present else None


def phase_bars(rows: list[dict[str, Any]], width: float = 640.0) -> dict[str, Any]:
    """Per rank, its phases as bars laid end to end on one scale (the slowest rank's step = `width`).

    `waited_for` is the rank with the most compute (every phase but comm): the others spend that
    difference waiting in the all-reduce, so it is the rank everyone waits for.
    """
    if not rows:
        return {"ranks": [], "scale_s": 0.0, "waited_for": None}
    totals = [sum(max(r[col] or 0.0, 0.0) for _, col in PHASES) for r in rows]
    scale = max(max(totals), 1e-9)
    compute = {r["rank"]: sum(max(r[c] or 0.0, 0.0) for p, c in PHASES if p != "comm") for r in rows}
    out = []
    for r, total in zip(rows, totals, strict=True):
        t = 0.0
        bars = []
        for name, c in PHASES:
            d = max(r[c] or 0.0, 0.0)
            bars.append({"phase": name, "seconds": d, "x": t / scale * width, "w": d / scale * width})
            t += d
        out.append({"rank": r["rank"], "node": r.get("node"), "total_s": total, "bars": bars})
    return {"ranks": out, "scale_s": scale, "waited_for": max(compute, key=lambda k: compute[k])}


GRID_METRICS = ("utilization", "memory", "temperature", "power", "throttle", "health")


def gpu_cell(metric: str, device: dict[str, Any]) -> dict[str, str]:
    """A grid cell's colour (CSS) and text for one device under `metric`, from its latest sample."""
    s = device.get("latest") or {}
    if not device.get("healthy", True) or s.get("xid") or (s.get("ecc_uncorrected") or 0) > 0:
        bad = device.get("unhealthy_reason") or _health_text(s)
        if metric == "health" or not s:
            return {"colour": "#c0392b", "text": bad or "unhealthy"}
    if not s:
        return {"colour": "#666", "text": "no sample"}
    if metric == "utilization":
        return _scale(s.get("utilization_pct"), 100.0, "{:.0f}%")
    if metric == "memory":
        used, total = s.get("memory_used_bytes"), s.get("memory_total_bytes")
        pct = 100.0 * used / total if used is not None and total else None
        return _scale(pct, 100.0, "{:.0f}% mem")
    if metric == "temperature":
        return _scale(s.get("temperature_c"), 95.0, "{:.0f} °C")
    if metric == "power":
        return _scale(s.get("power_w"), 700.0, "{:.0f} W")
    if metric == "throttle":
        reasons = s.get("throttle_reasons") or []
        return {"colour": "#d68910" if reasons else "#1e8449", "text": ", ".join(reasons) or "not throttled"}
    text = _health_text(s)
    return {"colour": "#c0392b" if text else "#1e8449", "text": text or "healthy"}


def _health_text(s: dict[str, Any]) -> str:
    parts = []
    if s.get("xid"):
        parts.append(f"XID {s['xid']}")
    if s.get("ecc_uncorrected"):
        parts.append(f"{s['ecc_uncorrected']} uncorrected ECC")
    return ", ".join(parts)


def _scale(value: float | None, full: float, fmt: str) -> dict[str, str]:
    """Green (low) to red (high) over [0, full]; grey when the device does not report it."""
    if value is None or not math.isfinite(value):
        return {"colour": "#666", "text": "n/a"}
    f = max(0.0, min(value / full, 1.0))
    hue = 120 * (1 - f)
    return {"colour": f"hsl({hue:.0f}, 65%, 40%)", "text": fmt.format(value)}


def topology(devices: list[dict[str, Any]], size: float = 260.0) -> dict[str, Any]:
    """A node's devices on a circle and its NVLink edges (each pair once), with the devices that run a
    job marked `busy`, for an SVG graph."""
    n = len(devices)
    r = size / 2 - 28
    c = size / 2
    nodes = []
    for i, d in enumerate(sorted(devices, key=lambda d: d["index"])):
        angle = -math.pi / 2 + 2 * math.pi * i / max(n, 1)
        nodes.append(
            {
                "index": d["index"],
                "x": round(c + (r * math.cos(angle) if n > 1 else 0), 1),
                "y": round(c + (r * math.sin(angle) if n > 1 else 0), 1),
                "busy": bool(d.get("job_id")),
                "job_id": d.get("job_id"),
                "healthy": d.get("healthy", True),
                "name": d.get("name", ""),
            }
        )
    where = {v["index"]: v for v in nodes}
    edges = sorted(
        {
            (min(d["index"], p), max(d["index"], p))
            for d in devices
            for p in d.get("nvlink_peers") or []
            if p in where and p != d["index"]
        }
    )
    return {
        "size": size,
        "nodes": nodes,
        "edges": [
            {
                "a": a,
                "b": b,
                "x1": where[a]["x"],
                "y1": where[a]["y"],
                "x2": where[b]["x"],
                "y2": where[b]["y"],
                "busy": where[a]["busy"] and where[b]["busy"] and where[a]["job_id"] == where[b]["job_id"],
            }
            for a, b in edges
        ],
    }
