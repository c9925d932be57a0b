"""The telemetry service: stores every step, GPU sample, status event and incident in Postgres,
traces each training step, and serves Prometheus metrics.

Each consumer takes batches from its durable consumer (`bus.consume_batches`: the next batch is
delivered while the current one is written) and writes a batch in one transaction; the bus
acknowledges the batch only after the handler returns, i.e. after the commit. Rows are keyed by
event_id, so a batch redelivered after a crash adds nothing twice.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import asyncpg
from opentelemetry import trace

from vigil.errors import RejectedEvents
from vigil.events import CheckpointSaved, GpuSampled, IncidentRaised, LaunchJob, Message, StepCompleted
from vigil_common import subjects, tracing
from vigil_common.bus import ConsumerSpec, Delivery
from vigil_common.origin import Origins
from vigil_common.service import connect as service_connect
from vigil_common.service import wait_any
from vigil_common.settings import Settings
from vigil_telemetry import partitions, store
from vigil_telemetry.alerts import outbox
from vigil_telemetry.alerts.delivery import Deliverer
from vigil_telemetry.metrics import Registry, serve_metrics
from vigil_telemetry.traces import StepTraces

log = logging.getLogger(__name__)

# A batch commits in well under a second; after a crash its messages come back after ACK_WAIT_S.
ACK_WAIT_S = 10.0
# Every rank sends one event per step: the steps stream is the one whose volume matters.
STEP_BATCH = 2000


def _spec(stream: subjects.StreamSpec, durable: str, filter_subject: str, **kw: int) -> ConsumerSpec:
    return ConsumerSpec(
        stream=stream,
        durable=durable,
        filter_subject=filter_subject,
        ack_wait_s=ACK_WAIT_S,
        shared=True,
        **kw,
    )


# Every consumer is shared by the telemetry replicas (a queue group): steps, samples and incidents need
# no order (rows are keyed by event id; "latest" tables compare occurred_at). Status events do (a
# rollback invalidates the checkpoints saved before it): one unacknowledged at a time keeps the stream's
# order across replicas.
STEPS = _spec(subjects.JOBS, "telemetry-steps", subjects.ALL_STEPS)
GPU = _spec(subjects.NODES, "telemetry-gpu", subjects.ALL_GPU)
STATUS = _spec(subjects.JOBS, "telemetry-status", subjects.ALL_STATUS, max_ack_pending=1)
LAUNCHES = _spec(subjects.JOBS, "telemetry-launches", subjects.ALL_LAUNCHES)
INCIDENTS = _spec(subjects.INCIDENTS, "telemetry-incidents", subjects.ALL_INCIDENTS)
# Alert routes' outbox (`alerts.outbox`), apart from the incidents' rows: a route's lookup never holds
# up what the API reads. A new durable starts an hour back, not at the stream's start.
ALERTS = ConsumerSpec(
    stream=subjects.INCIDENTS,
    durable="telemetry-alerts",
    filter_subject=subjects.ALL_INCIDENTS,
    ack_wait_s=ACK_WAIT_S,
    shared=True,
    replay_s=3600.0,
)

Batch = list[tuple[Message, Delivery]]
Writer = Callable[[asyncpg.Connection, Sequence[Any]], Awaitable[None]]
# What a row the database refuses raises (a value out of a column's range, a constraint, a character
# Postgres text cannot hold), never a lost connection: those batches are retried whole.
BAD_ROW = (
    asyncpg.DataError,  # SQLSTATE class 22: out of range, invalid text, ...
    asyncpg.IntegrityConstraintViolationError,  # class 23: NOT NULL, CHECK, ...
    asyncpg.exceptions._base.DataError,  # the client's: a value its column's type cannot encode
    OverflowError,
)


class Telemetry:
    """The batch handlers, around one pool, one metrics registry and the step traces."""

    def __init__(
        self,
        pool: asyncpg.Pool,
        registry: Registry,
        traces: StepTraces,
        deliverer: Deliverer | None = None,
        console_url: str = "",
    ) -> None:
        self.pool = pool
        self.registry = registry
        self.traces = traces
        self.deliverer = deliverer
        self.console_url = console_url

    async def _write(self, writer: Writer, batch: Batch, consumer: str) -> list[Message]:
        """Store a batch in one transaction; a batch the database refuses is split in halves until each
        bad event is alone (`stored_apart`), so one job's bad row never costs another job's rows. The
        events stored; RejectedEvents (after the rest is stored) names the bad ones for the bus to
        dead-letter."""
        rejected = await self._stored_apart(writer, batch)
        if rejected:
            events = [e for e, d in batch if d.stream_seq not in rejected]
        else:  # the common case: no delivery's metadata to parse
            events = [e for e, _ in batch]
        self.registry.observe(events)
        self.registry.inc("vigil_telemetry_events_total", len(events), consumer=consumer)
        if rejected:
            self.registry.inc("vigil_telemetry_rejected_total", len(rejected), consumer=consumer)
            raise RejectedEvents(rejected)
        return events

    async def _stored_apart(self, writer: Writer, batch: Batch) -> dict[int, str]:
        """Write `batch`, bisecting on a refused row; the rejected events' reasons by stream sequence."""
        if not batch:
            return {}
        try:
            async with self.pool.acquire() as conn, conn.transaction():
                await writer(conn, [e for e, _ in batch])
            return {}
        except BAD_ROW as exc:
            if len(batch) == 1:
                event, delivery = batch[0]
                log.error("telemetry: %s %s cannot be stored: %s", event.type, event.event_id, exc)
                return {delivery.stream_seq: f"not stored: {type(exc).__name__}: {exc}"[:2000]}
        half = len(batch) // 2
        first = await self._stored_apart(writer, batch[:half])
        return {**first, **await self._stored_apart(writer, batch[half:])}

    async def steps(self, batch: Batch) -> None:
        steps = [(e, d) for e, d in batch if isinstance(e, StepCompleted)]
        try:
            stored = await self._write(store.write_steps, steps, "steps")
        except RejectedEvents as exc:
            self._trace_steps([e for e, d in steps if d.stream_seq not in exc.reasons])
            raise
        self._trace_steps(stored)

    def _trace_steps(self, events: list[Message]) -> None:
        if self.traces.enabled:
            for e in events:
                if isinstance(e, StepCompleted):
                    self.traces.add_step(e)

    async def gpu(self, batch: Batch) -> None:
        await self._write(store.write_gpu, [(e, d) for e, d in batch if isinstance(e, GpuSampled)], "gpu")

    async def status(self, batch: Batch) -> None:
        for e in await self._write(_status_and_resolved_alerts, batch, "status"):
            if isinstance(e, CheckpointSaved):
                self.traces.add_checkpoint(e)

    async def incidents(self, batch: Batch) -> None:
        incidents = [(e, d) for e, d in batch if isinstance(e, IncidentRaised)]
        await self._write(store.write_incidents, incidents, "incidents")

    async def alerts(self, batch: Batch) -> None:
        """The deliveries the batch's incidents owe, written before the batch is acknowledged."""
        incidents = [e for e, _ in batch if isinstance(e, IncidentRaised)]
        async with self.pool.acquire() as conn, conn.transaction():
            added = await outbox.enqueue(conn, incidents, self.console_url)
        if added and self.deliverer is not None:
            self.deliverer.wake.set()

    async def launches(self, batch: Batch) -> None:
        for e, delivery in batch:
            if isinstance(e, LaunchJob):
                self.traces.launch(e, trace.get_current_span(delivery.trace_context).get_span_context())

    async def flush_traces(self, stop: asyncio.Event, every_s: float = 0.5) -> None:
        while not stop.is_set():
            self.traces.flush()
            await wait_any(stop, timeout_s=every_s)
        self.traces.flush(everything=True)


async def _status_and_resolved_alerts(conn: asyncpg.Connection, events: Sequence[Any]) -> None:
    """Status events stored, and the alertmanager alerts of a job that recovered resolved, at once."""
    await store.write_status(conn, events)
    await outbox.resolve(conn, events)


def console_url(settings: Settings) -> str:
    return settings.console_url or f"http://{settings.http_host}:{settings.http_port}"


async def run(settings: Settings, stop: asyncio.Event) -> None:
    """Connect, migrate, consume until `stop`, then drain and close."""
    # Step traces are built only when they go somewhere (OTLP or VIGIL_TRACE_FILE).
    traced = tracing.otlp_configured() or settings.trace_file is not None
    async with service_connect(settings, "telemetry") as conn:
        pool, bus = conn.pool, conn.bus
        registry = Registry()
        deliverer = Deliverer(pool, settings)
        t = Telemetry(
            pool, registry, StepTraces(conn.provider, enabled=traced), deliverer, console_url(settings)
        )
        async with asyncio.TaskGroup() as tasks:
            # steps and status are stored only from the nodes their launches placed them on
            admit = Origins(bus).admit
            tasks.create_task(bus.consume_batches(STEPS, t.steps, stop, max_batch=STEP_BATCH, admit=admit))
            tasks.create_task(bus.consume_batches(GPU, t.gpu, stop))
            # one unacknowledged at a time: no burst can gather, so waiting for one only adds latency
            tasks.create_task(bus.consume_batches(STATUS, t.status, stop, gather_s=0.0, admit=admit))
            tasks.create_task(bus.consume_batches(INCIDENTS, t.incidents, stop))
            tasks.create_task(bus.consume_batches(LAUNCHES, t.launches, stop))
            tasks.create_task(bus.consume_batches(ALERTS, t.alerts, stop))
            tasks.create_task(deliverer.run(stop))
            tasks.create_task(t.flush_traces(stop))
            tasks.create_task(partitions.maintain(pool, settings, stop))
            if settings.metrics_port:
                tasks.create_task(serve_metrics(registry, settings.http_host, settings.metrics_port, stop))
        log.info("telemetry stopped")
