"""Pure shaping for the console's pages: downsampled curves, the step trace's bars, the GPU grid's
colours and the NVLink graph's layout. No I/O: the pages feed them rows from the read model."""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

from vigil_common.readmodel import SERIES_METRICS

DEFAULT_POINTS = 1000
MAX_POINTS = 2000
PHASES = (  # (name, stored column): the trainer's phases in the order a step runs them
    ("data", "data_time_s"),
    ("forward", "forward_time_s"),
    ("backward", "backward_time_s"),
    ("comm", "comm_time_s"),
    ("optimizer", "optimizer_time_s"),
)


RANK_POINTS_BUDGET = 32_000  # points per metric over every rank's curve: 64 ranks get 500 each


def bucket_width(total_steps: int, points: int = DEFAULT_POINTS, ranks: int = 1) -> int:
    """Steps per bucket so that a curve of `total_steps` has at most `points` points, fewer for a job
    with many ranks (each rank's curve is shipped)."""
    points = max(1, min(points, MAX_POINTS, max(100, RANK_POINTS_BUDGET // max(ranks, 1))))
    return max(1, math.ceil(max(total_steps, 1) / points))


def series(rows: Iterable[dict[str, Any]], bucket: int) -> dict[str, Any]:
    """uPlot-ready columns from `readmodel.step_buckets` rows.

    `x` holds each bucket's first step; per metric, `ranks` has one column per rank (the rank's mean
    over the bucket, None where it has none), `mean` the mean over ranks (the sum for tokens/s),
    `lo`/`hi` the min and max of every finite value in the bucket over all ranks (the band that keeps
    a spike visible however many steps a point stands for), and `bad` the steps of buckets that held
    a NaN or Inf.
    """
    rows = list(rows)
    buckets = sorted({r["bucket"] for r in rows})
    ranks = sorted({r["rank"] for r in rows})
    at = {b: i for i, b in enumerate(buckets)}
    col = {rank: i for i, rank in enumerate(ranks)}
    n = len(buckets)
    x = [0] * n
    for r in rows:
        x[at[r["bucket"]]] = r["bucket"] * bucket if bucket > 1 else r["first_step"]
    metrics: dict[str, Any] = {}
    for m in SERIES_METRICS:
        per_rank: list[list[float | None]] = [[None] * n for _ in ranks]
        lo: list[float | None] = [None] * n
        hi: list[float | None] = [None] * n
        bad: set[int] = set()
        for r in rows:
            i = at[r["bucket"]]
            per_rank[col[r["rank"]]][i] = r[m]
            if r[f"{m}_lo"] is not None:
                lo[i] = r[f"{m}_lo"] if lo[i] is None else min(lo[i], r[f"{m}_lo"])
                hi[i] = r[f"{m}_hi"] if hi[i] is None else max(hi[i], r[f"{m}_hi"])
            if r[f"{m}_bad"]:
                bad.add(x[i])
        combine = _sum if m == "tokens_per_s" else _mean  # a job's throughput is its ranks' sum
        mean = [combine([c[i] for c in per_rank]) for i in range(n)]
        metrics[m] = {"ranks": per_rank, "mean": mean, "lo": lo, "hi": hi, "bad": sorted(bad)}
    last = max((r["last_step"] for r in rows), default=None)
    return {"bucket": bucket, "x": x, "ranks": ranks, "last_step": last, "metrics": metrics}


def _sum(values: list[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return sum(present) if present else None


def _mean(values: list[float | None]) -> float | None:
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
