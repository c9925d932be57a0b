"""Prometheus-format metrics at `/metrics`, from the events telemetry stores.

A small registry (gauges and counters with labels) and a minimal HTTP server on its own port;
the text format is Prometheus' exposition format 0.0.4.

What a dashboard needs (deploy/grafana/): per rank its newest step; per job its step, step rate,
loss, tokens/s and incidents; per device every sampled field. Label cardinality stays bounded:
every series with a `job` label goes when the job ends, so the series in use follow the running
jobs and the fleet's devices, not the history.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
from collections.abc import Sequence
from typing import assert_never

from vigil.events import (
    CheckpointRefused,
    CheckpointSaved,
    DeviceDiagnosed,
    GpuSampled,
    GuardianSettingsChanged,
    IncidentRaised,
    JobStateChanged,
    LaunchJob,
    Message,
    OutOfMemoryHalted,
    RankExited,
    RanksHalted,
    RankStarted,
    ReportRefused,
    RestartRequested,
    RollbackCompleted,
    StacksDumped,
    StepCompleted,
    StepReplayed,
    is_telemetry_input,
)
from vigil.jobstates import TERMINAL_STATES

log = logging.getLogger(__name__)

Labels = tuple[tuple[str, str], ...]
ENDED_REMEMBERED = 10_000  # ended jobs whose late events are ignored

_HELP: dict[str, tuple[str, str]] = {
    "vigil_step_loss": ("gauge", "Training loss of a rank's latest step"),
    "vigil_step_grad_norm": ("gauge", "Gradient norm of a rank's latest step"),
    "vigil_step_tokens_per_second": ("gauge", "Tokens per second of a rank's latest step"),
    "vigil_step_time_seconds": ("gauge", "Duration of a rank's latest step"),
    "vigil_step_comm_seconds": ("gauge", "Communication time of a rank's latest step"),
    "vigil_step_last": ("gauge", "Number of a rank's latest step"),
    "vigil_steps_total": ("counter", "Step events stored, per job"),
    "vigil_job_step": ("gauge", "Newest step of a running job (any rank)"),
    "vigil_job_steps_per_second": ("gauge", "Step rate of a running job (its slowest rank's newest step)"),
    "vigil_job_loss": ("gauge", "Mean loss of a running job's ranks at their newest steps"),
    "vigil_job_tokens_per_second": ("gauge", "Tokens per second of a running job, all ranks"),
    "vigil_job_incidents_total": ("counter", "Incidents raised about a running job, by kind and action"),
    "vigil_gpu_utilization_percent": ("gauge", "Device utilisation"),
    "vigil_gpu_memory_used_bytes": ("gauge", "Device memory in use"),
    "vigil_gpu_memory_total_bytes": ("gauge", "Device memory in all"),
    "vigil_gpu_temperature_celsius": ("gauge", "Device temperature"),
    "vigil_gpu_power_watts": ("gauge", "Device power draw"),
    "vigil_gpu_sm_clock_mhz": ("gauge", "Device SM (compute) clock"),
    "vigil_gpu_memory_clock_mhz": ("gauge", "Device memory clock"),
    "vigil_gpu_throttled": ("gauge", "1 while the device's clocks are held down for a reason, by reason"),
    "vigil_gpu_ecc_corrected": ("gauge", "Corrected memory errors since the driver loaded"),
    "vigil_gpu_ecc_uncorrected": ("gauge", "Uncorrected memory errors since the driver loaded"),
    "vigil_incidents_total": ("counter", "Incidents raised, by kind and action"),
    "vigil_telemetry_events_total": ("counter", "Events stored by telemetry, by consumer"),
    "vigil_telemetry_rejected_total": ("counter", "Events the database refused (dead-lettered), by consumer"),
}


class Registry:
    """Metric values by name and labels; `render()` gives the exposition text."""

    def __init__(self) -> None:
        self._values: dict[str, dict[Labels, float]] = {name: {} for name in _HELP}
        self._ended: dict[str, None] = {}  # jobs that ended, oldest first (an ordered set)
        # per job, the labels of its ranks' series: a job's aggregates read its own ranks, not every
        # rank of every job (which cost a batch time in the square of the fleet's size)
        self._rank_labels: dict[str | None, set[Labels]] = {}

    def set(self, name: str, value: float | None, **labels: object) -> None:
        if value is not None:
            self._values[name][_labels(labels)] = float(value)

    def inc(self, name: str, amount: float = 1.0, **labels: object) -> None:
        series = self._values[name]
        key = _labels(labels)
        series[key] = series.get(key, 0.0) + amount

    def get(self, name: str, **labels: object) -> float | None:
        return self._values[name].get(_labels(labels))

    def render(self) -> str:
        lines: list[str] = []
        for name, series in self._values.items():
            kind, text = _HELP[name]
            lines += [f"# HELP {name} {text}", f"# TYPE {name} {kind}"]
            for key, value in sorted(series.items()):
                label_text = ",".join(f'{k}="{_escape(v)}"' for k, v in key)
                lines.append(
                    f"{name}{{{label_text}}} {_number(value)}" if key else f"{name} {_number(value)}"
                )
        return "\n".join(lines) + "\n"

    # --- from events ----------------------------------------------------------------------------

    def observe(self, events: Sequence[Message]) -> None:
        newest: set[tuple[str | None, int]] = set()
        steps: dict[str | None, int] = {}  # per job, counted once a batch (labels cost more than events)
        ended = self._ended  # late events of an ended job (steps and status come on separate consumers)
        for e in reversed(events):  # gauges show each rank's (device's) newest value; older ones only count
            if not is_telemetry_input(e):  # the consumers decode only these (`subjects.CARRIES`)
                log.error(
                    "telemetry: %s %s is not an event telemetry stores: not counted", e.type, e.event_id
                )
                continue
            match e:
                case StepCompleted():
                    steps[e.job_id] = steps.get(e.job_id, 0) + 1
                    if (e.job_id, e.rank) in newest or e.job_id in ended:
                        continue
                    newest.add((e.job_id, e.rank))
                    key = _labels({"job": e.job_id, "rank": e.rank})
                    self._rank_labels.setdefault(e.job_id, set()).add(key)
                    for name, value in _rank_fields(e).items():
                        if value is not None:
                            self._values[name][key] = float(value)
                case GpuSampled():
                    if (e.node, e.index) in newest:
                        continue
                    newest.add((e.node, e.index))
                    self._gpu(e)
                case IncidentRaised():
                    self.inc("vigil_incidents_total", kind=e.kind, action=e.action)
                    if e.job_id and e.job_id not in ended:
                        self.inc("vigil_job_incidents_total", job=e.job_id, kind=e.kind, action=e.action)
                case JobStateChanged():
                    if e.to_state in TERMINAL_STATES and e.job_id:
                        self._end(
                            e.job_id
                        )  # events before this one (read newest first) are about an ended job
                case (
                    LaunchJob()
                    | RankStarted()
                    | RankExited()
                    | CheckpointSaved()
                    | RanksHalted()
                    | RollbackCompleted()
                    | RestartRequested()
                    | OutOfMemoryHalted()
                    | StepReplayed()
                    | ReportRefused()
                    | CheckpointRefused()
                    | DeviceDiagnosed()
                    | StacksDumped()
                    | GuardianSettingsChanged()
                ):
                    pass  # stored, counted by `vigil_telemetry_events_total` only
                case _:
                    assert_never(e)
        for job, n in steps.items():
            if job not in ended:
                self.inc("vigil_steps_total", n, job=job)
        touched = {e.job_id for e in events if isinstance(e, StepCompleted) and e.job_id} - ended.keys()
        for job in touched:
            self._job_aggregates(job)

    def _end(self, job: str) -> None:
        self._ended[job] = None
        while len(self._ended) > ENDED_REMEMBERED:
            del self._ended[next(iter(self._ended))]
        self.forget_job(job)

    def _gpu(self, e: GpuSampled) -> None:
        labels = {"node": e.node, "index": e.index, "kind": e.device_kind}
        self.set("vigil_gpu_utilization_percent", e.utilization_pct, **labels)
        self.set("vigil_gpu_memory_used_bytes", e.memory_used_bytes, **labels)
        self.set("vigil_gpu_memory_total_bytes", e.memory_total_bytes, **labels)
        self.set("vigil_gpu_temperature_celsius", e.temperature_c, **labels)
        self.set("vigil_gpu_power_watts", e.power_w, **labels)
        self.set("vigil_gpu_sm_clock_mhz", e.sm_clock_mhz, **labels)
        self.set("vigil_gpu_memory_clock_mhz", e.mem_clock_mhz, **labels)
        self.set("vigil_gpu_ecc_corrected", e.ecc_corrected, **labels)
        self.set("vigil_gpu_ecc_uncorrected", e.ecc_uncorrected, **labels)
        if e.device_kind == "gpu":  # a reason's series stays at 0 once it clears, so a graph shows it end
            series = self._values["vigil_gpu_throttled"]
            mine = {k for k in series if all(item in k for item in _labels(labels))}
            for key in mine:
                series[key] = 0.0
            for reason in e.throttle_reasons:
                self.set("vigil_gpu_throttled", 1.0, reason=reason, **labels)

    def _job_aggregates(self, job: str) -> None:
        """The job's gauges from its ranks' newest values."""

        ranks = self._rank_labels.get(job, set())

        def per_rank(name: str) -> list[float]:
            series = self._values[name]
            return [series[k] for k in ranks if k in series]

        steps, times = per_rank("vigil_step_last"), per_rank("vigil_step_time_seconds")
        losses, tokens = per_rank("vigil_step_loss"), per_rank("vigil_step_tokens_per_second")
        if steps:
            self.set("vigil_job_step", max(steps), job=job)
        if times and max(times) > 0:
            self.set("vigil_job_steps_per_second", 1.0 / max(times), job=job)
        if losses:
            self.set("vigil_job_loss", sum(losses) / len(losses), job=job)
        if tokens:
            self.set("vigil_job_tokens_per_second", sum(tokens), job=job)

    def forget_job(self, job: str) -> None:
        """Drop every series labelled with `job` (it ended: its series would only grow the scrape)."""
        self._rank_labels.pop(job, None)
        for series in self._values.values():
            for key in [k for k in series if ("job", job) in k]:
                del series[key]


def _rank_fields(e: StepCompleted) -> dict[str, float | None]:
    return {
        "vigil_step_loss": e.loss,
        "vigil_step_grad_norm": e.grad_norm,
        "vigil_step_tokens_per_second": e.tokens_per_s,
        "vigil_step_time_seconds": e.step_time_s,
        "vigil_step_comm_seconds": e.comm_time_s,
        "vigil_step_last": e.step,
    }


def _labels(labels: dict[str, object]) -> Labels:
    return tuple(sorted((k, str(v)) for k, v in labels.items()))


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _number(value: float) -> str:
    if math.isnan(value):
        return "NaN"
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    return repr(int(value)) if value.is_integer() and abs(value) < 1e15 else repr(value)


async def serve_metrics(registry: Registry, host: str, port: int, stop: asyncio.Event) -> None:
    """Serve `GET /metrics` until `stop` is set."""

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            request = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), timeout=5)
            method, path, *_ = request.split(b"\r\n", 1)[0].decode("latin-1").split(" ")
            if method == "GET" and path.split("?")[0] == "/metrics":
                status, body, ctype = "200 OK", registry.render().encode(), "text/plain; version=0.0.4"
            else:
                status, body, ctype = "404 Not Found", b"only GET /metrics here\n", "text/plain"
            head = f"HTTP/1.1 {status}\r\nContent-Type: {ctype}; charset=utf-8\r\n"
            head += f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n"
            writer.write(head.encode() + body)
            await writer.drain()
        except (TimeoutError, asyncio.IncompleteReadError, asyncio.LimitOverrunError, ValueError, OSError):
            pass
        finally:
            writer.close()
            with contextlib.suppress(OSError):
                await writer.wait_closed()

    try:
        server = await asyncio.start_server(handle, host, port)
    except OSError as exc:  # a busy port costs the metrics, not the telemetry service
        log.error(
            "telemetry: cannot serve /metrics on %s:%d (%s); set VIGIL_METRICS_PORT (0: off)", host, port, exc
        )
        return
    log.info("telemetry: metrics at http://%s:%d/metrics", host, port)
    try:
        await stop.wait()
    finally:
        server.close()
        await server.wait_closed()
