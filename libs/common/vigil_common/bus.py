"""The bus client: a small layer over nats-py JetStream.

- publish: `Nats-Msg-Id = <subject>|<event_id>` (JetStream drops duplicates inside the stream's
  window: the same event again on the same subject, never a message on another subject), waits for
  the publish ack, retries transient failures with the same id, and carries the W3C trace context in
  headers.
- consume: named durable push consumers (per message, or in batches); ack only after the handler's
  effect is done; nak with back-off on transient errors; term and dead-letter malformed messages,
  and go on. A message that its consumer did not deliver (its ack subject names another stream or
  consumer, or none) is dropped and logged, never acted on.
- watch: the stored messages of some subjects, read from their stream one by one (no consumer), for
  the CLI, SSE and the ranks' commands; scan: stored messages since a time, through a named consumer.

A connection's inboxes are its NATS user's (`_INBOX_<user>`): with the roles' permissions
(`vigil_common.credentials`) no other credential may read them or publish into them.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import logging
import ssl
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlsplit

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
    StreamSource,
    SubjectTransform,
)
from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider

from vigil_common import credentials, subjects, tracing
from vigil_common.errors import MalformedMessage, PermanentError, RetryableError
from vigil_common.events import Message, MessageDeadLettered, decode
from vigil_common.redact import redact_text, redact_url
from vigil_common.subjects import StreamSpec
from vigil_common.waiting import wait_any

log = logging.getLogger(__name__)

# The publishing connection's name (`Bus.connect(url, name)`), for the audit record of commands. Only
# roles allowed to publish a subject can publish there at all (see vigil_common.credentials).
SENDER_HEADER = "Vigil-Service"

Handler = Callable[[Message, "Delivery"], Awaitable[None]]
BatchHandler = Callable[[list[tuple[Message, "Delivery"]]], Awaitable[None]]
# Why an event on a subject is refused as forged, None when it is admitted (`vigil_common.origin`).
Admit = Callable[[str, Message], Awaitable[str | None]]

# A watcher reads its stream again this often when no wake-up came (one lost, or one that arrived
# before the message was stored); after a wake-up that found nothing yet, after these delays.
WATCH_RECHECK_S = 1.0
_STORE_WAIT_S = (0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2)

_TRANSIENT = (
    nats.errors.TimeoutError,
    nats.errors.ConnectionClosedError,
    nats.errors.NoRespondersError,
    nats.js.errors.NoStreamResponseError,
    asyncio.TimeoutError,
    OSError,
)


def msg_id(subject: str, event_id: str) -> str:
    """The `Nats-Msg-Id` of `event_id` published on `subject`. JetStream de-duplicates per stream, so the
    id is scoped by its subject: an event id reused on another subject (another job's) suppresses
    nothing there, and the same event published again on the same subject is still dropped."""
    return f"{subject}|{event_id}"


def not_delivered_by(msg: Msg, stream: str, consumer: str | None = None) -> str | None:
    """Why `msg` was not delivered by JetStream from `stream` (by `consumer`, when named); None when it
    was. Its ack subject (`$JS.ACK.<stream>.<consumer>...`) says which stream and consumer delivered it."""
    reply = msg.reply or ""
    tokens = reply.split(".")
    if tokens[:2] != ["$JS", "ACK"] or len(tokens) not in (9, 12, 13):
        return f"no JetStream ack subject (reply {reply!r})"
    at = 2 if len(tokens) == 9 else 4  # $JS.ACK.<stream>.<consumer>..., or with <domain>.<account> first
    if tokens[at] != stream:
        return f"delivered from stream {tokens[at]!r}, not {stream!r}"
    if consumer is not None and tokens[at + 1] != consumer:
        return f"delivered by consumer {tokens[at + 1]!r}, not {consumer!r}"
    return None


@dataclass(frozen=True)
class Stored:
    """A message read from a stream (`Bus.watch`): where it is stored, and what."""

    stream: str
    seq: int
    subject: str
    data: bytes


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
    """Decoded messages from `Bus.watch`, in stream order per subject. Iterate with `async for`, or call
    `next(timeout)`; a cancelled wait (a timeout, say) loses nothing and the stream goes on."""

    def __init__(self, queue: asyncio.Queue[Stored], decoder: Callable[[Stored], Message]) -> None:
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

    def __init__(
        self, nc: NatsClient, name: str, provider: TracerProvider | None = None, user: str | None = None
    ) -> None:
        self.nc = nc
        self.js: JetStreamContext = nc.jetstream()
        self.name = name
        self.user = user  # the NATS user (role) this connection logged in as; None: anonymous
        self.inbox_prefix = credentials.inbox_prefix(user)
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
        (a tls:// URL alone verifies against the system's CAs). The connection's inboxes are
        `_INBOX_<user>` for the user the URL names (`_INBOX` without one), the only inboxes that user's
        permissions let it read."""
        user = _user(url)

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
                    inbox_prefix=credentials.inbox_prefix(user),
                ),
                timeout=connect_timeout_s,
            )
        except (TimeoutError, nats.errors.NoServersError, OSError) as exc:
            reason = redact_text(str(exc)) or type(exc).__name__
            raise RetryableError(f"cannot reach NATS at {redact_url(url)}: {reason}") from exc
        nc_ref.append(nc)
        return cls(nc, name, provider, user)

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
                subjects=list(spec.subjects) or None,
                storage=StorageType.FILE,
                max_age=spec.max_age_s,
                max_bytes=spec.max_bytes,
                max_msgs=spec.max_msgs,
                max_msg_size=spec.max_msg_size,
                discard=DiscardPolicy.NEW if spec.discard_new else DiscardPolicy.OLD,
                duplicate_window=spec.duplicate_window_s,
                num_replicas=replicas,
            )
            if spec.source is not None:
                config.sources = [_source(spec.source)]
            try:
                await self.js.add_stream(config)
            except nats.js.errors.BadRequestError:
                if spec.source is not None:  # keeps copying from where it stands
                    config.sources = (await self.js.stream_info(spec.name)).config.sources
                await self.js.update_stream(config)  # exists with an older configuration

    # --- publish -------------------------------------------------------------------------------------

    async def publish(self, subject: str, event: Message, *, timeout_s: float = 10.0) -> PubAck:
        """Publish to JetStream and wait for the ack. Retries transient failures with the same
        `Nats-Msg-Id`, so a retry never stores a second copy. Raises RetryableError on timeout."""
        headers = tracing.inject({"Nats-Msg-Id": msg_id(subject, event.event_id), SENDER_HEADER: self.name})
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

    # --- listen (core NATS: what is published from now on, nothing stored is read) --------------------

    async def listen(
        self,
        subject: str,
        handler: Callable[[list[Message]], Awaitable[None]],
        stop: asyncio.Event,
        *,
        pending_limit: int = 65_536,
        hearing: asyncio.Event | None = None,
    ) -> None:
        """Run `handler` on the messages published on `subject`, in batches of what arrived while the
        last batch was handled, until `stop`. A core subscription: nothing stored is read back, and
        what is published while this process is away (or too far behind: past `pending_limit`) is
        not heard. For what is sent again and again, where every listener wants every message (each
        guardian hears every GPU sample); malformed messages are logged and skipped. `hearing` is set
        once the server has the subscription."""
        buffer: list[Message] = []
        arrived = asyncio.Event()

        async def on_msg(msg: Msg) -> None:
            try:
                buffer.append(self._decode(msg))
            except MalformedMessage as exc:
                log.warning("listen %s: skipped %s: %s", subject, msg.subject, exc)
                return
            arrived.set()

        sub = await self.nc.subscribe(subject, cb=on_msg, pending_msgs_limit=pending_limit)
        await self.nc.flush()
        if hearing is not None:
            hearing.set()
        try:
            while not stop.is_set():
                if not buffer:
                    arrived.clear()
                    await wait_any(arrived, stop)
                    continue
                batch, buffer[:] = list(buffer), []
                await handler(batch)
        finally:
            with contextlib.suppress(Exception):
                await sub.unsubscribe()

    # --- consume -------------------------------------------------------------------------------------

    def _decode(self, msg: Msg | Stored) -> Message:
        try:
            carries = subjects.CARRIES[subjects.kind_of(msg.subject)]
        except (KeyError, ValueError) as exc:
            raise MalformedMessage(f"subject {msg.subject!r} is not in the registry") from exc
        return decode(msg.data, carries)

    def _decode_stored(self, filter_subjects: Sequence[str], msg: Stored) -> Message:
        """Decode a stored message only if it was read from the stream that stores one of
        `filter_subjects`, on a subject they match."""
        wanted = [f for f in filter_subjects if subjects.matches(f, msg.subject)]
        if not wanted or msg.stream != subjects.stream_for(wanted[0]).name:
            raise MalformedMessage(
                f"{msg.subject!r} was not read from the stream of {', '.join(filter_subjects)} "
                f"(stream {msg.stream!r}): ignored"
            )
        return self._decode(msg)

    async def _admitted(self, msg: Msg, admit: Admit | None) -> Message:
        """The decoded message, if `admit` (when given) admits it; MalformedMessage if not."""
        event = self._decode(msg)
        if admit is not None and (why := await admit(subjects.unshared(msg.subject), event)) is not None:
            log.warning("refused a forged %s on %s: %s", event.type, msg.subject, why)
            raise MalformedMessage(f"refused as forged: {why}")
        return event

    def _foreign(self, spec: ConsumerSpec, msg: Msg) -> bool:
        """True (and logged) when `msg` was not delivered by `spec`'s consumer: pushed into its inbox by
        someone else, or delivered by another consumer (a forged or replayed delivery). Such a message
        is never acted on, acknowledged or dead-lettered: it is not this consumer's to settle."""
        why = not_delivered_by(msg, spec.stream.name, spec.durable)
        if why is None and not subjects.matches(spec.filter_subject, msg.subject):
            why = f"subject {msg.subject!r} is outside the consumer's filter {spec.filter_subject!r}"
        if why is not None:
            log.error(
                "%s: dropped a message on %s not delivered by this consumer: %s",
                spec.durable,
                msg.subject,
                why,
            )
            return True
        return False

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

    async def consume(
        self, spec: ConsumerSpec, handler: Handler, stop: asyncio.Event, *, admit: Admit | None = None
    ) -> None:
        """Run `handler` on each message, in order, until `stop` is set; ack after it returns. A message
        `admit` refuses is dead-lettered as forged and never reaches the handler.

        The server pushes (at most `max_ack_pending` unacknowledged) and the handler runs in the
        subscription's own task as each message arrives: no fetch round trip, no hand-off in
        between. On `stop` the message being handled finishes; messages received but not yet
        handled are nak'd, back to the server at once.
        """

        async def on_msg(msg: Msg) -> None:
            if self._foreign(spec, msg):
                return
            if stop.is_set():
                await msg.nak()
            else:
                await self._handle_one(spec, msg, handler, admit)

        sub = await self._push(spec, on_msg)
        try:
            await stop.wait()
        finally:
            # A handler stuck past ack_wait is left to the connection's close, which ends it.
            with contextlib.suppress(Exception):
                await asyncio.wait_for(sub.drain(), spec.ack_wait_s)

    async def _handle_one(self, spec: ConsumerSpec, msg: Msg, handler: Handler, admit: Admit | None) -> None:
        delivery = Delivery(msg)
        try:
            event = await self._admitted(msg, admit)
        except Exception as exc:  # malformed or forged: dead-lettered; a failed check: retried
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
        admit: Admit | None = None,
    ) -> None:
        """Run `handler` on batches of up to `max_batch` messages; every message of a batch is
        acked after the handler returns, or nak'd (dead-lettered past `max_deliver`) if it raises.
        A message `admit` refuses is dead-lettered as forged and left out of its batch.

        For volume (every rank's every step): the server pushes into a buffer (at most
        `max_ack_pending` unacknowledged) while the previous batch is being handled, so
        receiving and writing overlap. A batch that is not full waits `gather_s` for a burst.
        """
        buffer: list[Msg] = []
        arrived = asyncio.Event()

        async def on_msg(msg: Msg) -> None:
            if not self._foreign(spec, msg):
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
                await self._handle_batch(spec, batch, handler, admit)
        finally:
            stopped.cancel()
            with contextlib.suppress(Exception):
                await sub.unsubscribe()
                for msg in buffer:  # received but not handled: back to the server at once
                    await msg.nak()

    async def _push(self, spec: ConsumerSpec, on_msg: Callable[[Msg], Awaitable[None]]) -> Any:
        config = ConsumerConfig(
            # Named: the name is in the create request's subject (`$JS.API.CONSUMER.CREATE.<stream>.
            # <name>.<filter>`), where the roles' permissions allow each role its own names only.
            name=spec.durable,
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
        """A durable created before it was shared (or with another max_ack_pending, or delivering
        outside this connection's inboxes) cannot be bound as it is now: it is replaced by one that
        starts after the old one's acknowledged messages."""
        try:
            info = await self.js.consumer_info(spec.stream.name, spec.durable)
        except nats.js.errors.NotFoundError:
            return
        shared = bool(info.config.deliver_group)
        # delivered into another prefix's inbox (`_INBOX.`, before each role had its own), which this
        # connection may not read
        inbox = (info.config.deliver_subject or "").startswith(f"{self.inbox_prefix}.")
        if shared == spec.shared and info.config.max_ack_pending == spec.max_ack_pending and inbox:
            return
        start = info.ack_floor.stream_seq + 1 if info.ack_floor else 1
        log.warning(
            "%s: replacing the durable consumer (shared: %s -> %s, deliver subject %s), from #%d",
            spec.durable,
            shared,
            spec.shared,
            info.config.deliver_subject,
            start,
        )
        with contextlib.suppress(nats.js.errors.NotFoundError):
            await self.js.delete_consumer(spec.stream.name, spec.durable)
        config.deliver_policy = DeliverPolicy.BY_START_SEQUENCE
        config.opt_start_seq = start

    async def _handle_batch(
        self, spec: ConsumerSpec, batch: list[Msg], handler: BatchHandler, admit: Admit | None
    ) -> None:
        good: list[tuple[Message, Delivery]] = []
        for msg in batch:
            delivery = Delivery(msg)
            try:
                good.append((await self._admitted(msg, admit), delivery))
            except Exception as exc:  # malformed or forged: dead-lettered; a failed check: retried
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
        """The messages stored on `filter_subjects` from now on (all of them with `from_start`), in
        stream order per subject.

        Usage: `async with bus.watch(subjects.ALL_INCIDENTS) as events: async for event in events: ...`

        No consumer: each subject's stream is read one message after another (`$JS.API.STREAM.MSG.GET`,
        the next stored on the subject after the last one read), woken by a core subscription to the
        subject. A JetStream consumer made without a name could carry any name in its request and
        replace another role's consumer, so the roles may not make one; and what is read is only what
        the stream stored, answered to this connection's own inbox: nothing pushed by anyone else
        reaches a watcher (ranks act only on commands from the command stream). Malformed messages
        are logged and skipped (nothing durable depends on a watcher).
        """
        queue: asyncio.Queue[Stored] = asyncio.Queue()
        subs: list[Any] = []
        followers: list[asyncio.Task[None]] = []
        try:
            for subject in filter_subjects:
                stream = subjects.stream_for(subject).name
                woken = asyncio.Event()

                async def wake(_msg: Msg, woken: asyncio.Event = woken) -> None:
                    woken.set()

                subs.append(await self.nc.subscribe(subject, cb=wake))  # before the start is read
                start = 1 if from_start else (await self.js.stream_info(stream)).state.last_seq + 1
                followers.append(
                    asyncio.create_task(
                        self._follow(stream, subject, start, woken, queue), name=f"watch {subject}"
                    )
                )
            yield EventStream(queue, functools.partial(self._decode_stored, filter_subjects))
        finally:
            await _cancel(followers)
            for sub in subs:
                with contextlib.suppress(Exception):
                    await sub.unsubscribe()

    async def _follow(
        self, stream: str, subject: str, seq: int, woken: asyncio.Event, out: asyncio.Queue[Stored]
    ) -> None:
        """Put every message stored on `subject` from sequence `seq` on into `out`, for ever."""
        delays: list[float] = []  # after a wake-up that found nothing: the message may not be stored yet
        while True:
            woken.clear()
            before = seq
            seq = await self._read_stored(stream, subject, seq, out)
            if seq > before:
                delays = []
            if woken.is_set():
                continue
            if delays:
                await _wait(woken, delays.pop(0))
                continue
            if await _wait(woken, WATCH_RECHECK_S):
                delays = list(_STORE_WAIT_S)

    async def _read_stored(self, stream: str, subject: str, seq: int, out: asyncio.Queue[Stored]) -> int:
        """Read the messages stored on `subject` from sequence `seq` into `out`; the next sequence."""
        delay = 0.05
        while True:
            try:
                raw = await self.js.get_msg(stream, seq=seq, subject=subject, next=True)
            except nats.js.errors.NotFoundError:
                return seq
            except (*_TRANSIENT, nats.errors.Error, nats.js.errors.Error) as exc:
                # a short outage is routine; one that lasts (or a read the role may not make) is not
                level = logging.WARNING if delay == 1.6 else logging.DEBUG
                log.log(level, "watch %s: reading %s failed, again in %.2fs: %r", subject, stream, delay, exc)
                await asyncio.sleep(delay)  # back-off while the server is away
                delay = min(delay * 2, 2.0)
                continue
            if raw.seq is None or raw.seq < seq or raw.subject is None:
                return seq
            seq = raw.seq + 1
            out.put_nowait(Stored(stream, raw.seq, raw.subject, raw.data or b""))

    # --- scan ------------------------------------------------------------------------------------------

    async def scan(
        self,
        name: str,
        filter_subject: str,
        *,
        since: float,
        upto: int | None = None,
        admit: Admit | None = None,
    ) -> AsyncIterator[Message]:
        """The messages stored on `filter_subject` since `since` (epoch seconds), up to stream sequence
        `upto`, read through the named pull consumer `name` (made for the scan, deleted after it).
        Malformed messages are skipped, and so are a message that consumer did not deliver and one
        `admit` refuses. One scan per name at a time: a scan that finds the name taken (another
        process's scan) waits for it to end."""
        stream = subjects.stream_for(filter_subject).name
        config = ConsumerConfig(
            name=name,
            deliver_policy=DeliverPolicy.BY_START_TIME,
            opt_start_time=datetime.fromtimestamp(max(since, 0.0), tz=UTC) - timedelta(seconds=1),
            ack_policy=AckPolicy.NONE,
            filter_subject=filter_subject,
            inactive_threshold=5.0,  # a scan left by a process that died goes soon
        )
        await self._create_only(stream, config)
        sub = await self.js.pull_subscribe_bind(name, stream=stream)
        try:
            while True:
                try:
                    msgs = await sub.fetch(500, timeout=1.0)
                except (nats.errors.TimeoutError, TimeoutError):
                    return
                for msg in msgs:
                    if (why := not_delivered_by(msg, stream, name)) is not None:
                        log.error("scan %s: dropped a message on %s: %s", name, msg.subject, why)
                        continue
                    if upto is not None and msg.metadata.sequence.stream > upto:
                        return
                    try:
                        event = await self._admitted(msg, admit)
                    except MalformedMessage as exc:
                        log.warning("scan %s: skipped %s: %s", name, msg.subject, exc)
                        continue
                    yield event
                if not msgs or msgs[-1].metadata.num_pending == 0:
                    return
        finally:
            with contextlib.suppress(Exception):
                await sub.unsubscribe()
            with contextlib.suppress(Exception):
                await self.js.delete_consumer(stream, name)

    async def _create_only(self, stream: str, config: ConsumerConfig, timeout_s: float = 60.0) -> None:
        """Create the named consumer `config` describes, never updating one that exists (the request's
        `action: create`): while one of that name exists, wait for it to go."""
        assert config.name
        subject = f"$JS.API.CONSUMER.CREATE.{stream}.{config.name}.{config.filter_subject}"
        body = json.dumps({"stream_name": stream, "config": config.as_dict(), "action": "create"}).encode()
        deadline = time.monotonic() + timeout_s
        delay = 0.05
        while True:
            reply = json.loads((await self.nc.request(subject, body, timeout=5.0)).data)
            error = reply.get("error")
            if error is None:
                return
            if error.get("err_code") != 10148 or time.monotonic() > deadline:  # 10148: exists already
                raise RetryableError(f"consumer {config.name} on {stream}: {error.get('description')}")
            await asyncio.sleep(delay)  # back-off while another process's scan runs
            delay = min(delay * 2, 1.0)


def _source(spec: subjects.SourceSpec) -> StreamSource:
    return StreamSource(
        name=spec.stream,
        opt_start_time=datetime.fromtimestamp(time.time() - spec.backfill_s, tz=UTC),
        subject_transforms=[SubjectTransform(src=spec.src, dest=spec.dest)],
    )


async def _cancel(tasks: Sequence[asyncio.Task[None]]) -> None:
    """Cancel `tasks` and wait until they end. A task is cancelled again while it runs on: Python 3.11's
    `asyncio.wait_for` (which nats-py's requests use) drops a cancellation that comes as its awaited
    result arrives, and a follower that lost one would read for ever."""
    pending = set(tasks)
    while pending:
        for task in pending:
            task.cancel()
        _, pending = await asyncio.wait(pending, timeout=0.5)
    for task in tasks:
        if not task.cancelled() and task.exception() is not None:
            log.debug("watch %s ended with %r", task.get_name(), task.exception())


async def _wait(event: asyncio.Event, timeout_s: float) -> bool:
    """Wait for `event` at most `timeout_s`; True when it is set."""
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(event.wait(), timeout_s)
    return event.is_set()


def _user(url: str) -> str | None:
    """The NATS user a URL names with a password (the first server's, for a list), or None. A user
    without a password is a token (`nats://<token>@host`), never taken for a name."""
    parts = urlsplit(url.split(",")[0].strip())
    return unquote(parts.username) if parts.username and parts.password is not None else None
