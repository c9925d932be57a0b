"""The transactional outbox: events are written in the transaction that changes the state, and a
relay publishes them afterwards, in order, with the event's `Nats-Msg-Id` (its subject and event_id).

A crash between the publish and the `published_at` update re-publishes the row on restart;
JetStream drops the copy inside the stream's duplicate window, and workers also ignore a launch
for an attempt they have already run.
"""

from __future__ import annotations

import asyncio
import json
import logging

import asyncpg
from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider

from vigil.errors import VigilError
from vigil.events import Message, decode
from vigil_common import tracing
from vigil_common.bus import Bus
from vigil_common.service import wait_any

log = logging.getLogger(__name__)


async def enqueue(
    conn: asyncpg.Connection, subject: str, event: Message, headers: dict[str, str] | None = None
) -> None:
    """Add `event` to the outbox inside the caller's transaction.

    `headers` carries the trace context to publish with; by default the current span's.
    """
    await conn.execute(
        """INSERT INTO outbox (event_id, subject, type, job_id, attempt, payload, headers)
           VALUES ($1, $2, $3, $4, $5, $6, $7)""",
        event.event_id,
        subject,
        event.type,
        event.job_id,
        event.attempt,
        event.to_bytes(),
        json.dumps(headers if headers is not None else tracing.inject({})),
    )


class Relay:
    """Publishes unpublished outbox rows in id order; `wake()` after a commit that added rows."""

    def __init__(
        self, pool: asyncpg.Pool, bus: Bus, provider: TracerProvider | None = None, batch: int = 200
    ):
        self.pool = pool
        self.bus = bus
        self.batch = batch
        self._wake = asyncio.Event()
        self._tracer = tracing.tracer(provider, "vigil.scheduler.outbox")

    def wake(self) -> None:
        self._wake.set()

    async def run(self, stop: asyncio.Event, poll_s: float = 1.0) -> None:
        """Relay until `stop`; a failed publish is retried on the next round, keeping the order."""
        rounds = 0
        while not stop.is_set():
            try:
                while await self.publish_pending():
                    pass
                rounds += 1
                if rounds % 3600 == 1:
                    await self.prune()
            except (VigilError, OSError, asyncpg.PostgresError) as exc:
                log.warning("outbox relay: %s; retrying", exc)
            await wait_any(self._wake, stop, timeout_s=poll_s)
            self._wake.clear()

    async def publish_pending(self) -> int:
        """Publish one batch of pending rows; returns how many were published."""
        async with self.pool.acquire() as conn, conn.transaction():
            # SKIP LOCKED: a second relay (another scheduler) takes other rows instead of waiting.
            rows = await conn.fetch(
                """SELECT id, subject, payload, headers FROM outbox
                   WHERE published_at IS NULL ORDER BY id LIMIT $1 FOR UPDATE SKIP LOCKED""",
                self.batch,
            )
            done: list[int] = []
            failure: Exception | None = None
            for row in rows:
                try:
                    await self._publish(row)
                except (VigilError, OSError) as exc:
                    failure = exc  # keep the order: the rest waits for the next round
                    break
                done.append(row["id"])
            if done:
                await conn.execute(
                    "UPDATE outbox SET published_at = now() WHERE id = ANY($1::bigint[])", done
                )
        if failure is not None:
            raise failure
        return len(done)

    async def prune(self, keep_days: float = 1.0) -> None:
        """Forget published events after a while; launches stay (they guard one launch per attempt)."""
        await self.pool.execute(
            """DELETE FROM outbox WHERE published_at < now() - make_interval(secs => $1)
               AND type <> 'job.launch'""",
            keep_days * 86_400,
        )

    async def _publish(self, row: asyncpg.Record) -> None:
        event = decode(bytes(row["payload"]))
        token = otel_context.attach(tracing.extract(json.loads(row["headers"])))
        try:
            with self._tracer.start_as_current_span(f"publish {event.type}", kind=trace.SpanKind.PRODUCER):
                await self.bus.publish(row["subject"], event)
        finally:
            otel_context.detach(token)
