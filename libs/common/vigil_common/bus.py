"""The bus client: a small layer over nats-py JetStream.

- publish: `Nats-Msg-Id = event_id` (JetStream drops duplicates inside the stream's window),
  waits for the publish ack, retries transient failures with the same id, and carries the
  W3C trace context in headers.
- consume: durable push consumers (per message, or in batches); ack only after the handler's
  effect is done; nak with back-off on transient errors; term and dead-letter malformed
  messages, and go on.
- watch: an ephemeral ordered consumer of new messages, for the CLI, SSE and tests.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import ssl
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import nats
import nats.errors
import nats.js.errors
from nats.aio.client import Client as NatsClient
from nats.aio.msg import Msg
from nats.js import JetStreamContext
from nats.js.api import (
    AckPolicy,
    ConsumerConfig,
    DeliverPolicy,
    DiscardPolicy,
    PubAck,
    StorageType,
    StreamConfig,
)
from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider

from vigil_common import subjects, tracing
from vigil_common.errors import MalformedMessage, PermanentError, RetryableError
from vigil_common.events import Message, MessageDeadLettered, decode
from vigil_common.redact import redact_text, redact_url
from vigil_common.subjects import StreamSpec

log = logging.getLogger(__name__)

# The publishing connection's name (`Bus.connect(url, name)`), for the audit record of commands. Only
# roles allowed to publish a subject can publish there at all (see vigil_common.credentials).
SENDER_HEADER = "Vigil-Service"

Handler = Callable[[Message, "Delivery"], Awaitable[None]]
BatchHandler = Callable[[list[tuple[Message, "Delivery"]]], Awaitable[None]]

_TRANSIENT = (
    nats.errors.TimeoutError,
    nats.errors.ConnectionClosedError,
    nats.errors.NoRespondersError,
    nats.js.errors.NoStreamResponseError,
    asyncio.TimeoutError,
    OSError,
)


@dataclass(frozen=True)
class ConsumerSpec:
    """A durable consumer on one stream."""

    stream: StreamSpec
    durable: str
    filter_subject: str
    ack_wait_s: float = 30.0
    max_deliver: int = 8  # then the message is dead-lettered, never retried forever
    max_ack_pending: int = 20_000
    deliver_new: bool = False  # a new durable starts at new messages instead of the stream's start
    # A new durable starts at the messages stored in the last `replay_s` seconds (a bounded replay)
    # instead of the stream's start; an existing durable goes on from where it is, whatever this says.
    replay_s: float | None = None
    # Shared by several replicas of a service (a queue group named after the durable): each message
    # goes to one of them. With max_ack_pending=1 the group still handles messages in stream order.
    shared: bool = False
    backoff_s: tuple[float, ...] = (0.1, 0.5, 2.0, 5.0, 15.0)

    def __post_init__(self) -> None:
        subjects.token(self.durable, "durable consumer name")

    def delay(self, num_delivered: int) -> float:
        return self.backoff_s[min(num_delivered, len(self.backoff_s)) - 1]


@dataclass
class Delivery:
    """One delivered message, as a handler sees it. Headers, metadata and trace context are
    parsed on first use: a batch consumer that never asks pays nothing for them."""

    msg: Msg

    @property
    def subject(self) -> str:
        return self.msg.subject

    @functools.cached_property
    def headers(self) -> dict[str, str]:
        return dict(self.msg.headers or {})

    @functools.cached_property
    def _meta(self) -> Any:
        return self.msg.metadata

    @property
    def num_delivered(self) -> int:
        return self._meta.num_delivered

    @property
    def stream_seq(self) -> int:
        return self._meta.sequence.stream

    @property
    def num_pending(self) -> int:
        """Messages of the consumer still to be delivered after this one."""
        return self._meta.num_pending

    @functools.cached_property
    def trace_context(self) -> otel_context.Context:
        return tracing.extract(self.headers)


class EventStream:
    """Decoded messages from `Bus.watch`, in arrival order. Iterate with `async for`, or call
    `next(timeout)`; a cancelled wait (a timeout, say) loses nothing and the stream goes on."""

    def __init__(self, queue: asyncio.Queue[Msg], decoder: Callable[[Msg], Message]) -> None:
        self._queue = queue
        self._decode = decoder

    def __aiter__(self) -> EventStream:
        return self

    async def __anext__(self) -> Message:
        while True:
            msg = await self._queue.get()
            try:
                return self._decode(msg)
            except MalformedMessage as exc:
                log.warning("watch: skipping malformed message on %s: %s", msg.subject, exc)

    async def next(self, timeout: float | None = None) -> Message | None:
        """The next message, or None when none arrives within `timeout` seconds."""
        try:
            return await asyncio.wait_for(self.__anext__(), timeout)
        except TimeoutError:
            return None


class Bus:
    """A connected NATS client with JetStream. Build with `await Bus.connect(url, name)`."""

    def __init__(self, nc: NatsClient, name: str, provider: TracerProvider | None = None) -> None:
        self.nc = nc
        self.js: JetStreamContext = nc.jetstream()
        self.name = name
        self._tracer = tracing.tracer(provider, "vigil.bus")

    @classmethod
    async def connect(
        cls,
        url: str,
        name: str,
        *,
        provider: TracerProvider | None = None,
        connect_timeout_s: float = 10.0,
        tls_ca: Path | None = None,
    ) -> Bus:
        """Connect, retrying until `connect_timeout_s`; once connected, reconnect forever. `tls_ca`
        (VIGIL_NATS_TLS_CA): the CA that signed the server's certificate, for a server with a private CA
        (a tls:// URL alone verifies against the system's CAs)."""

        async def on_disconnect() -> None:
            if not nc_ref or not (nc_ref[0].is_closed or nc_ref[0].is_draining):
                log.warning("bus %s: disconnected from NATS, reconnecting", name)

        async def on_reconnect() -> None:
            log.info("bus %s: reconnected to NATS", name)

        async def on_error(exc: Exception) -> None:
            log.warning("bus %s: %s", name, exc)

        nc_ref: list[NatsClient] = []
        try:
            nc = await asyncio.wait_for(
                nats.connect(
                    url,
                    name=name,
                    connect_timeout=2,
                    allow_reconnect=True,
                    max_reconnect_attempts=-1,
                    reconnect_time_wait=0.5,
                    disconnected_cb=on_disconnect,
                    reconnected_cb=on_reconnect,
                    error_cb=on_error,
                    tls=ssl.create_default_context(cafile=str(tls_ca)) if tls_ca else None,
                ),
                timeout=connect_timeout_s,
            )
        except (TimeoutError, nats.errors.NoServersError, OSError) as exc:
            reason = redact_text(str(exc)) or type(exc).__name__
            raise RetryableError(f"cannot reach NATS at {redact_url(url)}: {reason}") from exc
        nc_ref.append(nc)
        return cls(nc, name, provider)

    async def close(self) -> None:
        """Drain subscriptions and pending publishes, then close."""
        if not self.nc.is_closed:
            with contextlib.suppress(Exception):
                await self.nc.drain()

    async def __aenter__(self) -> Bus:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    # --- streams -------------------------------------------------------------------------------------

    async def ensure_streams(
        self, specs: Sequence[StreamSpec] = subjects.STREAMS, *, manage: bool = True, replicas: int = 1
    ) -> None:
        """Create or update every stream, kept on `replicas` servers of a NATS cluster
        (`settings.stream_replicas`); safe to call from many starters at once.

        With `manage=False` (a service whose NATS role may not change streams: see
        `vigil_common.credentials`) a stream that exists is left as it is, and only a missing one is
        created (which a restricted credential is refused: the scheduler or `vigil up` creates them)."""
        if manage:
            await self._retire_legacy_steps(specs)
        for spec in specs:
            if not manage:
                try:
                    await self.js.stream_info(spec.name)
                    continue
                except nats.js.errors.NotFoundError:
                    pass
            config = StreamConfig(
                name=spec.name,
                description=spec.description,
                subjects=list(spec.subjects),
                storage=StorageType.FILE,
                max_age=spec.max_age_s,
                max_bytes=spec.max_bytes,
                max_msgs=spec.max_msgs,
                max_msg_size=spec.max_msg_size,
                discard=DiscardPolicy.NEW if spec.discard_new else DiscardPolicy.OLD,
                duplicate_window=spec.duplicate_window_s,
                num_replicas=replicas,
            )
            try:
                await self.js.add_stream(config)
            except nats.js.errors.BadRequestError:
                await self.js.update_stream(config)  # exists with an older configuration
        if manage:
            await self._copy_legacy_steps()

    async def _retire_legacy_steps(self, specs: Sequence[StreamSpec]) -> None:
        """Moving a deployment made when steps had a stream of their own (`subjects.LEGACY_STEPS`),
        first half: that stream stops taking steps, so that VIGIL_JOBS may take them."""
        if subjects.JOBS not in specs:
            return
        try:
            info = await self.js.stream_info(subjects.LEGACY_STEPS)
        except nats.js.errors.NotFoundError:
            return
        if list(info.config.subjects or []) != [subjects.RETIRED_STEPS]:
            log.warning(
                "moving step events from stream %s into %s", subjects.LEGACY_STEPS, subjects.JOBS.name
            )
            info.config.subjects = [subjects.RETIRED_STEPS]
            await self.js.update_stream(info.config)

    async def _copy_legacy_steps(self) -> None:
        """Second half: the steps that some consumer of the old stream had not acknowledged are
        published again (same `Nats-Msg-Id`, same subject, so into VIGIL_JOBS), then the old stream,
        and the guardian's old consumers on VIGIL_JOBS, are deleted. Run again after a crash, it
        copies again; consumers of steps are idempotent on the event id."""
        try:
            info = await self.js.stream_info(subjects.LEGACY_STEPS)
        except nats.js.errors.NotFoundError:
            return
        first = info.state.last_seq + 1
        for consumer in await self.js.consumers_info(subjects.LEGACY_STEPS):
            first = min(first, consumer.ack_floor.stream_seq + 1 if consumer.ack_floor else 1)
        copied = 0
        for seq in range(max(first, info.state.first_seq), info.state.last_seq + 1):
            try:
                raw = await self.js.get_msg(subjects.LEGACY_STEPS, seq)
            except nats.js.errors.NotFoundError:
                continue  # deleted or aged out
            headers = {k: v for k, v in (raw.headers or {}).items() if not k.startswith("Nats-Expected")}
            await self.js.publish(raw.subject, raw.data or b"", headers=headers)
            copied += 1
        await self.js.delete_stream(subjects.LEGACY_STEPS)
        for name in subjects.LEGACY_CONSUMERS:
            with contextlib.suppress(nats.js.errors.NotFoundError):
                await self.js.delete_consumer(subjects.JOBS.name, name)
        log.warning(
            "stream %s deleted after %d unconsumed steps were copied into %s",
            subjects.LEGACY_STEPS,
            copied,
            subjects.JOBS.name,
        )

    # --- publish -------------------------------------------------------------------------------------

    async def publish(self, subject: str, event: Message, *, timeout_s: float = 10.0) -> PubAck:
        """Publish to JetStream and wait for the ack. Retries transient failures with the same
        `Nats-Msg-Id`, so a retry never stores a second copy. Raises RetryableError on timeout."""
        headers = tracing.inject({"Nats-Msg-Id": event.event_id, SENDER_HEADER: self.name})
        payload = event.to_bytes()
        deadline = time.monotonic() + timeout_s
        delay = 0.05
        while True:
            try:
                return await self.js.publish(
                    subject, payload, timeout=max(0.1, min(2.0, deadline - time.monotonic())), headers=headers
                )
            except nats.js.errors.ServiceUnavailableError as exc:
                if time.monotonic() + delay >= deadline:
                    raise RetryableError(f"JetStream unavailable for {subject}: {exc.description}") from exc
            except nats.js.errors.APIError as exc:
                # e.g. a full stream with discard=new: permanent for this message, never silent.
                raise PermanentError(f"publish to {subject} refused: {exc.description}") from exc
            except _TRANSIENT as exc:
                if time.monotonic() + delay >= deadline:
                    raise RetryableError(f"publish to {subject} not acknowledged in {timeout_s}s") from exc
            await asyncio.sleep(delay)  # back-off between retries, not synchronisation
            delay = min(delay * 2, 1.0)

    # --- request/reply (core NATS, not stored) ---------------------------------------------------------

    async def request(self, subject: str, event: Message, *, timeout_s: float = 5.0) -> Message:
        headers = tracing.inject({})
        msg = await self.nc.request(subject, event.to_bytes(), timeout=timeout_s, headers=headers)
        return decode(msg.data)

    async def serve(self, subject: str, handler: Callable[[Message], Awaitable[Message]]) -> Any:
        """Answer requests on `subject` with `handler`; returns the subscription (unsubscribe to stop)."""

        async def on_msg(msg: Msg) -> None:
            reply = await handler(decode(msg.data))
            await msg.respond(reply.to_bytes())

        return await self.nc.subscribe(subject, cb=on_msg)

    # --- consume -------------------------------------------------------------------------------------

    def _decode(self, msg: Msg) -> Message:
        try:
            carries = subjects.CARRIES[subjects.kind_of(msg.subject)]
        except (KeyError, ValueError) as exc:
            raise MalformedMessage(f"subject {msg.subject!r} is not in the registry") from exc
        return decode(msg.data, carries)

    def _decode_stored(self, filter_subjects: Sequence[str], msg: Msg) -> Message:
        """Decode a message only if JetStream delivered it from the stream that stores one of
        `filter_subjects` (its reply subject carries the stream's name), on a subject they match."""
        wanted = [f for f in filter_subjects if subjects.matches(f, msg.subject)]
        try:
            stream = msg.metadata.stream if msg.reply and msg.reply.startswith("$JS.ACK.") else None
        except Exception:  # a reply subject that is not JetStream's metadata
            stream = None
        if not wanted or stream != subjects.stream_for(wanted[0]).name:
            raise MalformedMessage(
                f"{msg.subject!r} was not delivered from the stream of {', '.join(filter_subjects)} "
                f"(stream {stream!r}): ignored"
            )
        return self._decode(msg)

    async def dead_letter(self, spec: ConsumerSpec, delivery: Delivery, reason: str) -> None:
        """Record a terminated message on the dead-letter stream (idempotent per stream sequence)."""
        log.error(
            "%s: dead-lettering %s #%d: %s", spec.durable, delivery.subject, delivery.stream_seq, reason
        )
        event = MessageDeadLettered(
            event_id=f"dl-{spec.stream.name}-{spec.durable}-{delivery.stream_seq}",
            stream=spec.stream.name,
            consumer=spec.durable,
            subject=delivery.subject,
            reason=reason[:4000],
            payload=delivery.msg.data.decode("utf-8", errors="replace")[:100_000],
            num_delivered=delivery.num_delivered,
        )
        await self.publish(subjects.dead_letter(spec.stream.name), event)

    async def _fail(self, spec: ConsumerSpec, delivery: Delivery, exc: BaseException) -> None:
        """Classify a handler failure: terminate permanent ones, nak transient ones with back-off."""
        if isinstance(exc, PermanentError) or delivery.num_delivered >= spec.max_deliver:
            await self.dead_letter(spec, delivery, f"{type(exc).__name__}: {exc}")
            await delivery.msg.term()
        else:
            log.warning(
                "%s: %s #%d failed (delivery %d), retrying: %s",
                spec.durable,
                delivery.subject,
                delivery.stream_seq,
                delivery.num_delivered,
                exc,
            )
            await delivery.msg.nak(delay=spec.delay(delivery.num_delivered))

    async def consume(self, spec: ConsumerSpec, handler: Handler, stop: asyncio.Event) -> None:
        """Run `handler` on each message, in order, until `stop` is set; ack after it returns.

        The server pushes (at most `max_ack_pending` unacknowledged) and the handler runs in the
        subscription's own task as each message arrives: no fetch round trip, no hand-off in
        between. On `stop` the message being handled finishes; messages received but not yet
        handled are nak'd, back to the server at once.
        """

        async def on_msg(msg: Msg) -> None:
            if stop.is_set():
                await msg.nak()
            else:
                await self._handle_one(spec, msg, handler)

        sub = await self._push(spec, on_msg)
        try:
            await stop.wait()
        finally:
            # A handler stuck past ack_wait is left to the connection's close, which ends it.
            with contextlib.suppress(Exception):
                await asyncio.wait_for(sub.drain(), spec.ack_wait_s)

    async def _handle_one(self, spec: ConsumerSpec, msg: Msg, handler: Handler) -> None:
        delivery = Delivery(msg)
        try:
            event = self._decode(msg)
        except MalformedMessage as exc:
            await self._fail(spec, delivery, exc)
            return
        with self._tracer.start_as_current_span(
            f"consume {spec.durable}", context=delivery.trace_context, kind=trace.SpanKind.CONSUMER
        ):
            try:
                await handler(event, delivery)
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                await self._fail(spec, delivery, exc)
            else:
                await msg.ack()

    async def consume_batches(
        self,
        spec: ConsumerSpec,
        handler: BatchHandler,
        stop: asyncio.Event,
        *,
        max_batch: int = 500,
        gather_s: float = 0.02,
    ) -> None:
        """Run `handler` on batches of up to `max_batch` messages; every message of a batch is
        acked after the handler returns, or nak'd (dead-lettered past `max_deliver`) if it raises.

        For volume (every rank's every step): the server pushes into a buffer (at most
        `max_ack_pending` unacknowledged) while the previous batch is being handled, so
        receiving and writing overlap. A batch that is not full waits `gather_s` for a burst.
        """
        buffer: list[Msg] = []
        arrived = asyncio.Event()

        async def on_msg(msg: Msg) -> None:
            buffer.append(msg)
            arrived.set()

        sub = await self._push(spec, on_msg)
        stopped = asyncio.ensure_future(stop.wait())
        try:
            while not stop.is_set():
                if not buffer:
                    arrived.clear()
                    waiting = asyncio.ensure_future(arrived.wait())
                    await asyncio.wait({waiting, stopped}, return_when=asyncio.FIRST_COMPLETED)
                    waiting.cancel()
                    if stop.is_set():
                        break
                if len(buffer) < max_batch:
                    await asyncio.sleep(gather_s)  # let a burst gather into one batch
                batch, buffer[:] = buffer[:max_batch], buffer[max_batch:]
                await self._handle_batch(spec, batch, handler)
        finally:
            stopped.cancel()
            with contextlib.suppress(Exception):
                await sub.unsubscribe()
                for msg in buffer:  # received but not handled: back to the server at once
                    await msg.nak()

    async def _push(self, spec: ConsumerSpec, on_msg: Callable[[Msg], Awaitable[None]]) -> Any:
        config = ConsumerConfig(
            durable_name=spec.durable,
            deliver_subject=self.nc.new_inbox(),
            deliver_group=spec.durable if spec.shared else None,
            ack_policy=AckPolicy.EXPLICIT,
            ack_wait=spec.ack_wait_s,
            max_deliver=spec.max_deliver + 1,
            max_ack_pending=spec.max_ack_pending,
            filter_subject=spec.filter_subject,
            deliver_policy=DeliverPolicy.NEW if spec.deliver_new else DeliverPolicy.ALL,
        )
        if spec.replay_s is not None:
            config.deliver_policy = DeliverPolicy.BY_START_TIME
            config.opt_start_time = datetime.fromtimestamp(time.time() - spec.replay_s, tz=UTC)
        await self._replace_if_reshaped(spec, config)
        deadline = time.monotonic() + 10.0
        while True:
            try:
                return await self.js.subscribe(
                    spec.filter_subject,
                    durable=spec.durable,
                    stream=spec.stream.name,
                    queue=spec.durable if spec.shared else None,
                    cb=on_msg,
                    manual_ack=True,
                    config=config,
                    pending_msgs_limit=4 * spec.max_ack_pending,
                )
            except nats.js.errors.Error as exc:
                # A previous subscriber (this service before a restart) is still bound until the
                # server notices it has gone.
                # Replicas sharing a durable that start together: the second's create loses the race
                # ("consumer name already in use") and binds to the first's on the next try.
                retry = "already bound" in str(exc) or (spec.shared and "already in use" in str(exc))
                if not retry or time.monotonic() > deadline:
                    raise
                await asyncio.sleep(0.1)  # back-off while the server drops the old binding

    async def _replace_if_reshaped(self, spec: ConsumerSpec, config: ConsumerConfig) -> None:
        """A durable created before it was shared (or with another max_ack_pending) cannot be bound
        as it is now: it is replaced by one that starts after the old one's acknowledged messages."""
        try:
            info = await self.js.consumer_info(spec.stream.name, spec.durable)
        except nats.js.errors.NotFoundError:
            return
        shared = bool(info.config.deliver_group)
        if shared == spec.shared and info.config.max_ack_pending == spec.max_ack_pending:
            return
        start = info.ack_floor.stream_seq + 1 if info.ack_floor else 1
        log.warning(
            "%s: replacing the durable consumer (shared: %s -> %s), from #%d",
            spec.durable,
            shared,
            spec.shared,
            start,
        )
        with contextlib.suppress(nats.js.errors.NotFoundError):
            await self.js.delete_consumer(spec.stream.name, spec.durable)
        config.deliver_policy = DeliverPolicy.BY_START_SEQUENCE
        config.opt_start_seq = start

    async def _handle_batch(self, spec: ConsumerSpec, batch: list[Msg], handler: BatchHandler) -> None:
        good: list[tuple[Message, Delivery]] = []
        for msg in batch:
            delivery = Delivery(msg)
            try:
                good.append((self._decode(msg), delivery))
            except MalformedMessage as exc:
                await self._fail(spec, delivery, exc)
        if not good:
            return
        try:
            await handler(good)
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            for _, delivery in good:
                await self._fail(spec, delivery, exc)
        else:
            for _, delivery in good:
                await delivery.msg.ack()

    # --- watch -----------------------------------------------------------------------------------------

    @contextlib.asynccontextmanager
    async def watch(
        self, *filter_subjects: str, from_start: bool = False
    ) -> AsyncIterator[AsyncIterator[Message]]:
        """Ephemeral ordered consumers of `filter_subjects` (new messages, or all with `from_start`).

        Usage: `async with bus.watch(subjects.ALL_INCIDENTS) as events: async for event in events: ...`
        Malformed messages are logged and skipped (nothing durable depends on a watcher), and so is
        a message that was not delivered from the stream storing `filter_subjects` (one published
        straight into the watcher's inbox, say): ranks act only on commands from the command stream.
        """
        queue: asyncio.Queue[Msg] = asyncio.Queue()

        async def on_msg(msg: Msg) -> None:
            queue.put_nowait(msg)

        subs = []
        try:
            for subject in filter_subjects:
                subs.append(
                    await self.js.subscribe(
                        subject,
                        cb=on_msg,
                        ordered_consumer=True,
                        deliver_policy=DeliverPolicy.ALL if from_start else DeliverPolicy.NEW,
                    )
                )

            yield EventStream(queue, functools.partial(self._decode_stored, filter_subjects))
        finally:
            for sub in subs:
                with contextlib.suppress(Exception):
                    await sub.unsubscribe()
