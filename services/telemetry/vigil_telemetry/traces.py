"""One OpenTelemetry trace per training step per job, built from the ranks' measured times.

The root span `train.step` runs from the first rank's start of the step to the last rank's end
(a rank's step ends when its StepCompleted was created and started `step_time_s` before). Under
it, per rank, the phases `data`, `forward`, `backward`, `communication` and `optimizer` are laid
end to end from the rank's start with their measured durations, and a `checkpoint` span follows
the step when the job saved one after it (from CheckpointSaved). Every span carries the job,
attempt, step and (per rank) rank. The root links to the launch's trace (submit -> schedule ->
launch), whose context came in the LaunchJob's message headers.

A step's trace is emitted when every rank has reported it (the world size comes from the launch),
or after `max_wait_s` with whatever came.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import dataclass, field

from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.trace import Link, SpanContext

from vigil.events import CheckpointSaved, LaunchJob, StepCompleted

PHASES = (
    ("data", "data_time_s"),
    ("forward", "forward_time_s"),
    ("backward", "backward_time_s"),
    ("communication", "comm_time_s"),
    ("optimizer", "optimizer_time_s"),
)
_NS = 1_000_000_000
MAX_PENDING = 10_000
MAX_LAUNCHES = 10_000


@dataclass
class _Pending:
    events: dict[int, StepCompleted] = field(default_factory=dict)
    first_seen: float = field(default_factory=time.monotonic)
    checkpoint: CheckpointSaved | None = None


class StepTraces:
    """Collects step events and emits one trace per (job, attempt, step)."""

    def __init__(
        self, provider: TracerProvider | None, *, max_wait_s: float = 2.0, enabled: bool = True
    ) -> None:
        self.enabled = enabled
        self._tracer = (
            provider.get_tracer("vigil.telemetry") if provider else trace.get_tracer("vigil.telemetry")
        )
        self.max_wait_s = max_wait_s
        self._pending: OrderedDict[tuple[str, int, int], _Pending] = OrderedDict()
        self._launches: OrderedDict[tuple[str, int], tuple[int, SpanContext | None]] = OrderedDict()
        self.emitted = 0

    def launch(self, event: LaunchJob, context: SpanContext | None = None) -> None:
        """Remember a launch's world size (and its trace, to link to)."""
        if event.job_id is None:
            return
        self._launches[(event.job_id, event.attempt)] = (
            event.world_size,
            context if context is not None and context.is_valid else None,
        )
        while len(self._launches) > MAX_LAUNCHES:
            self._launches.popitem(last=False)

    def add_step(self, event: StepCompleted) -> None:
        key = (event.job_id or "", event.attempt, event.step)
        pending = self._pending.setdefault(key, _Pending())
        pending.events[event.rank] = event
        world = self._launches.get((key[0], key[1]), (None, None))[0]
        if world is not None and len(pending.events) >= world:
            self._emit(key, self._pending.pop(key))
        while len(self._pending) > MAX_PENDING:
            self._emit(*self._pending.popitem(last=False))

    def add_checkpoint(self, event: CheckpointSaved) -> None:
        """A checkpoint with step s was saved after step s - 1: its span joins that step's trace."""
        if event.step == 0:
            return  # the start-of-training checkpoint follows no step
        key = (event.job_id or "", event.attempt, event.step - 1)
        pending = self._pending.get(key)
        if pending is not None:
            pending.checkpoint = event
        else:  # the step's trace is out already: the checkpoint gets a trace of its own
            self._checkpoint_span(event, None, None)

    def flush(self, *, everything: bool = False) -> None:
        """Emit the steps that waited longer than `max_wait_s` (all of them with `everything`)."""
        now = time.monotonic()
        for key in [
            k for k, p in self._pending.items() if everything or now - p.first_seen >= self.max_wait_s
        ]:
            self._emit(key, self._pending.pop(key))

    def _emit(self, key: tuple[str, int, int], pending: _Pending) -> None:
        job, attempt, step = key
        events = sorted(pending.events.values(), key=lambda e: e.rank)
        ends = {e.rank: _ns(e.occurred_at.timestamp()) for e in events}
        starts = {e.rank: ends[e.rank] - int(e.step_time_s * _NS) for e in events}
        start, end = min(starts.values()), max(ends.values())
        if pending.checkpoint is not None:
            end = max(end, _ns(pending.checkpoint.occurred_at.timestamp()))
        attrs = {
            "vigil.job_id": job,
            "vigil.attempt": attempt,
            "vigil.step": step,
            "vigil.ranks": len(events),
        }
        linked = self._launches.get((job, attempt), (None, None))[1]
        root = self._tracer.start_span(
            "train.step",
            context=trace.set_span_in_context(trace.INVALID_SPAN),
            start_time=start,
            attributes={
                **attrs,
                "vigil.loss": _mean([e.loss for e in events]),
                "vigil.skipped": any(e.skipped for e in events),
            },
            links=[Link(linked)] if linked else None,
        )
        ctx = trace.set_span_in_context(root)
        for e in events:
            t = starts[e.rank]
            for name, attr in PHASES:
                duration = int(max(getattr(e, attr), 0.0) * _NS)
                span = self._tracer.start_span(
                    name,
                    context=ctx,
                    start_time=t,
                    attributes={**attrs, "vigil.rank": e.rank, "vigil.node_name": e.node},
                )
                span.end(end_time=t + duration)
                t += duration
        if pending.checkpoint is not None:
            self._checkpoint_span(pending.checkpoint, ctx, max(ends.values()))
        root.end(end_time=end)
        self.emitted += 1

    def _checkpoint_span(self, event: CheckpointSaved, ctx: object, start: int | None) -> None:
        end = _ns(event.occurred_at.timestamp())
        span = self._tracer.start_span(
            "checkpoint",
            context=ctx if ctx is not None else trace.set_span_in_context(trace.INVALID_SPAN),
            start_time=start if start is not None else end,
            attributes={
                "vigil.job_id": event.job_id or "",
                "vigil.attempt": event.attempt,
                "vigil.step": event.step - 1,
                "vigil.checkpoint_step": event.step,
                "vigil.path": event.path,
                "vigil.bytes": event.bytes,
            },
        )
        span.end(end_time=max(end, start or end))


def _ns(seconds: float) -> int:
    return int(seconds * _NS)


def _mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else float("nan")
