"""The step trace from OpenTelemetry span data: the console reads the JSON lines that telemetry writes
to `VIGIL_TRACE_FILE` (one span per line, see vigil_common.tracing), keeping the spans of one job's
step. Spans exported only over OTLP live in the collector (Jaeger, ...): the console cannot read
those, and says so."""

from __future__ import annotations

import json
from collections.abc import Iterable
from datetime import datetime
from pathlib import Path
from typing import Any

# telemetry's span names (vigil_telemetry.traces.PHASES) -> the phase names of the stored step rows
SPAN_PHASES = {
    "data": "data_time_s",
    "forward": "forward_time_s",
    "backward": "backward_time_s",
    "communication": "comm_time_s",
    "optimizer": "optimizer_time_s",
}


def phases_from_spans(
    lines: Iterable[str], job_id: str, step: int, attempt: int | None
) -> list[dict[str, Any]]:
    """Per rank, the durations of its phase spans for (job, step[, attempt]), shaped like the stored
    step rows (`data_time_s`, ...), from span JSON lines. A step traced twice (re-run after a
    rollback) keeps the newest trace."""
    needle = f'"{job_id}"'
    by_trace: dict[str, dict[int, dict[str, Any]]] = {}
    started: dict[str, str] = {}
    for line in lines:
        if needle not in line or '"vigil.rank"' not in line:
            continue  # cheap filter before parsing: most lines are other jobs' or other steps' spans
        try:
            span = json.loads(line)
        except json.JSONDecodeError:
            continue  # a line cut short while telemetry writes it
        attrs = span.get("attributes") or {}
        col = SPAN_PHASES.get(span.get("name", ""))
        if (
            col is None
            or attrs.get("vigil.job_id") != job_id
            or attrs.get("vigil.step") != step
            or (attempt is not None and attrs.get("vigil.attempt") != attempt)
        ):
            continue
        trace_id = span["context"]["trace_id"]
        rank = int(attrs["vigil.rank"])
        row = by_trace.setdefault(trace_id, {}).setdefault(
            rank, {"rank": rank, "node": attrs.get("vigil.node_name"), "attempt": attrs.get("vigil.attempt")}
        )
        row[col] = _seconds(span["start_time"], span["end_time"])
        started[trace_id] = max(started.get(trace_id, ""), span["start_time"])
    if not by_trace:
        return []
    newest = max(by_trace, key=lambda t: started[t])
    rows = [by_trace[newest][r] for r in sorted(by_trace[newest])]
    for row in rows:
        for col in SPAN_PHASES.values():
            row.setdefault(col, 0.0)
    return rows


def read_step_spans(
    path: Path | None, job_id: str, step: int, attempt: int | None
) -> list[dict[str, Any]] | None:
    """The spans of one step from the trace file; None when there is no trace file to read."""
    if path is None or not path.exists():
        return None
    with path.open(errors="replace") as f:
        return phases_from_spans(f, job_id, step, attempt)


def _seconds(start: str, end: str) -> float:
    return max((_time(end) - _time(start)), 0.0)


def _time(value: str) -> float:
    return datetime.fromisoformat(value.replace("Z", "+00:00")).timestamp()
