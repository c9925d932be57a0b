"""The bus client: a small layer over nats-py JetStream.

- publish: `Nats-Msg-Id = event_id` (JetStream drops duplicates inside the stream's window),
  waits for the publish ack, retries transient failures with the same id, and carries the
  W3C trace context in headers.
- consume: durable pull consumers; ack only after the handler's effect is done; nak with
  back-off on transient errors; term and dead-letter malformed messages, and go on.
- consume_batches: the same guarantees for high-volume streams, on a lean receive path: pull
  requests kept topped up (the next batch streams in while the current one is handled), raw
  messages (no per-message header parsing, `Msg` object or task hop), one write for a batch's acks.
- watch: an ephemeral ordered consumer of new messages, for the CLI, SSE and tests.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import re
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass
from functools import cached_property
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
from nats.protocol.parser import AWAITING_CONTROL_LINE, MAX_CONTROL_LINE_SIZE, Parser
from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
from pydantic import ValidationError

from vigil_common import subjects, tracing
from vigil_common.errors import MalformedMessage, PermanentError, RetryableError
from vigil_common.events import Message, MessageDeadLettered, decode
from vigil_common.subjects import StreamSpec

log = logging.getLogger(__name__)

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
    """A durable pull consumer on one stream."""

    stream: StreamSpec
    durable: str
    filter_subject: str
    ack_wait_s: float = 30.0
    max_deliver: int = 8  # then the message is dead-lettered, never retried forever
    max_ack_pending: int = 20_000
    deliver_new: bool = False  # a new durable starts at new messages instead of the stream's start
    backoff_s: tuple[float, ...] = (0.1, 0.5, 2.0, 5.0, 15.0)

    def __post_init__(self) -> None:
        subjects.token(self.durable, "durable consumer name")

    def delay(self, num_delivered: int) -> float:
        return self.backoff_s[min(num_delivered, len(self.backoff_s)) - 1]


class Delivery:
    """One delivered message, as a handler sees it: `subject`, `headers`, `num_delivered`,
    `stream_seq`, `trace_context`, and `msg` (nats-py's, to ack, nak or term it).

    Batch consumers build it from the raw wire fields; the headers, the trace context and `msg`
    are made only when something asks for them (a batch of thousands seldom does).
    """

    def __init__(
        self,
        nc: NatsClient,
        subject: str,
        reply: bytes,
        data: bytes,
        raw_headers: bytes | None = None,
        msg: Msg | None = None,
    ) -> None:
        self.subject = subject
        self.reply = reply
        self.data = data
        self._nc = nc
        self._raw_headers = raw_headers
        if msg is not None:
            self.__dict__["msg"] = msg
            self.__dict__["headers"] = dict(msg.headers or {})

    @classmethod
    def of(cls, nc: NatsClient, msg: Msg) -> Delivery:
        """The delivery of a message nats-py has already parsed."""
        return cls(nc, msg.subject, msg.reply.encode(), msg.data, msg=msg)

    @cached_property
    def headers(self) -> dict[str, str]:
        return _parse_headers(self._raw_headers)

    @cached_property
    def msg(self) -> Msg:
        return Msg(
            _client=self._nc,
            subject=self.subject,
            reply=self.reply.decode(),
            data=self.data,
            headers=self.headers or None,
        )

    @cached_property
    def trace_context(self) -> otel_context.Context:
        return tracing.extract(self.headers)

    @property
    def num_delivered(self) -> int:
        return self.msg.metadata.num_delivered

    @property
    def stream_seq(self) -> int:
        return self.msg.metadata.sequence.stream


def _parse_headers(raw: bytes | None) -> dict[str, str]:
    """`NATS/1.0[ status]\r\nName: value\r\n...` as a dict (the status line is not a header)."""
    out: dict[str, str] = {}
    for line in (raw or b"").split(b"\r\n")[1:]:
        name, sep, value = line.partition(b":")
        if sep and name.strip():
            out[name.strip().decode("ascii", "replace")] = value.strip().decode("utf-8", "replace")
    return out


class _Parser(Parser):
    """nats-py's protocol parser with a fast path for whole MSG/HMSG frames already in the buffer
    (a split on the control line instead of two regular expressions, one buffer cut per read
    instead of one per message). Everything else, and any frame it is unsure of, goes to nats-py's."""

    async def parse(self, data: bytes = b"") -> None:
        buf = self.buf
        buf.extend(data)
        pos, end = 0, len(buf)
        sinks: dict[int, _Puller] = self.nc.sinks
        filled: set[_Puller] = set()
        partial = False  # a MSG/HMSG frame not all here yet: wait for more bytes
        while self.state == AWAITING_CONTROL_LINE and pos < end:
            if buf.startswith(b"HMSG ", pos):
                skip, n_args = 5, 5
            elif buf.startswith(b"MSG ", pos):
                skip, n_args = 4, 4
            else:
                partial = end - pos < 5 and (b"HMSG ".startswith(buf[pos:]) or b"MSG ".startswith(buf[pos:]))
                break
            eol = buf.find(b"\r\n", pos)
            if eol < 0:
                partial = end - pos < MAX_CONTROL_LINE_SIZE
                break
            args = bytes(buf[pos + skip : eol]).split()
            try:
                total, sid = int(args[-1]), int(args[1])
                header_size = int(args[-2]) if skip == 5 else 0
            except (ValueError, IndexError):
                break  # nats-py's parser reports it
            start = eol + 2
            if start + total + 2 > end:
                partial = True
                break
            reply = args[2] if len(args) == n_args else b""
            headers = bytes(buf[start : start + header_size]) if header_size else None
            payload = bytes(buf[start + header_size : start + total])
            pos = start + total + 2
            sink = sinks.get(sid)
            if sink is not None and reply:  # a batch consumer's message: straight into its list
                sink.items.append((args[0], reply, payload, headers))
                filled.add(sink)
                continue
            await self.nc._process_msg(sid, args[0], reply, payload, headers)
            if self.buf is not buf:  # reset by a reconnect meanwhile
                return
        for sink in filled:
            sink.arrived.set()
        if pos:
            del buf[:pos]
        if buf and not partial:
            await super().parse()


RawMsg = tuple[bytes, bytes, bytes, bytes | None]  # subject, reply, data, headers: as they came


class _Client(NatsClient):
    """nats-py's client plus raw sinks: a subscription registered in `sinks` gets its messages as
    `RawMsg` bytes, skipping nats-py's per-message header parsing, `Msg` object, queue and task
    hop (together ~25 us a message: more than decoding and storing a step event). Batch consumers
    use it; every other subscription goes through nats-py unchanged."""

    def __init__(self) -> None:
        super().__init__()
        self.sinks: dict[int, _Puller] = {}
        self._ps = _Parser(self)

    async def _process_msg(  # type: ignore[override]
        self, sid: int, subject: bytes, reply: bytes, data: bytes, headers: bytes | None
    ) -> None:
        sink = self.sinks.get(sid)
        if sink is None:
            await super()._process_msg(sid, subject, reply, data, headers)
        else:
            self.stats["in_msgs"] += 1
            sink.put(subject, reply, data, headers)

    async def send_acks(self, replies: Sequence[bytes], ack: bytes = b"+ACK") -> None:
        """Explicit acks (or naks: `-NAK`) of many JetStream messages, one per message, in one write."""
        if self.is_closed:
            raise nats.errors.ConnectionClosedError
        if replies:
            command = b"PUB %b " + str(len(ack)).encode() + b"\r\n" + ack + b"\r\n"
            await self._send_command(b"".join([command % r for r in replies]))
            if self._flush_queue is not None and self._flush_queue.empty():
                await self._flush_pending()


_PENDING_MSGS = re.compile(rb"Nats-Pending-Messages:\s*(\d+)", re.IGNORECASE)


class _Puller:
    """Pull requests for one durable consumer, kept topped up to about `2 * max_batch` messages so
    the next batch streams in while the current one is handled. Messages land in `items` raw."""

    EXPIRES_S = 5.0

    def __init__(self, nc: _Client, spec: ConsumerSpec, inbox: str, max_batch: int) -> None:
        self.nc = nc
        self.spec = spec
        self.inbox = inbox
        self.next_subject = f"$JS.API.CONSUMER.MSG.NEXT.{spec.stream.name}.{spec.durable}"
        self.want = 2 * max_batch
        self.outstanding = 0  # requested, not yet delivered nor expired
        self.deadline = 0.0  # every request outstanding has expired by then
        self.items: list[RawMsg] = []
        self.counted = 0  # of `items`, those already taken off `outstanding`
        self.arrived = asyncio.Event()

    def put(self, subject: bytes, reply: bytes, data: bytes, headers: bytes | None) -> None:
        if reply:  # a message from the stream (its reply is the ack subject)
            self.items.append((subject, reply, data, headers))
            self.arrived.set()
            return
        # A status: "NATS/1.0 408 Request Timeout" (a request expired), 409 (ended: max waiting,
        # leadership change, consumer deleted...), 100 (heartbeat), 404 (nothing for a no-wait).
        code = (headers or b"")[9:12]
        if code in (b"408", b"409", b"404", b"400"):
            pending = _PENDING_MSGS.search(headers or b"")
            if pending:  # of that request, not delivered
                self.outstanding -= int(pending.group(1))
            else:
                self.outstanding, self.counted = 0, len(self.items)
            if code != b"408":
                log.warning("%s: pull request ended: %r", self.spec.durable, (headers or b"")[9:].strip())
            self.arrived.set()

    def _count_delivered(self) -> None:
        self.outstanding = max(0, self.outstanding - (len(self.items) - self.counted))
        self.counted = len(self.items)

    async def top_up(self) -> None:
        self._count_delivered()
        now = time.monotonic()
        if self.outstanding and now > self.deadline:  # expired though no status said so (a reconnect)
            self.outstanding = 0
        if self.outstanding <= self.want // 2:
            n = self.want - self.outstanding
            request = json.dumps({"batch": n, "expires": int(self.EXPIRES_S * 1e9)}).encode()
            await self.nc.publish(self.next_subject, request, reply=self.inbox)
            self.outstanding += n
            self.deadline = now + self.EXPIRES_S + 1.0

    async def take(self, max_batch: int, max_wait_s: float, stop: asyncio.Event) -> list[RawMsg]:
        """Up to `max_batch` messages: as soon as any are here, after `max_wait_s` for a burst to
        gather; empty when `stop` is set first."""
        while not self.items and not stop.is_set():
            self.arrived.clear()
            with contextlib.suppress(_TRANSIENT, nats.errors.ConnectionReconnectingError):
                await self.top_up()
            await _first_of(self.arrived, stop, timeout=self.EXPIRES_S / 2)
        if self.items and len(self.items) < max_batch and max_wait_s > 0 and not stop.is_set():
            await asyncio.sleep(max_wait_s)  # let a burst gather into one batch
        self._count_delivered()
        batch, self.items = self.items[:max_batch], self.items[max_batch:]
        self.counted = len(self.items)
        with contextlib.suppress(_TRANSIENT, nats.errors.ConnectionReconnectingError):
            await self.top_up()  # the next batch streams in while this one is handled
        return batch


async def _first_of(a: asyncio.Event, b: asyncio.Event, *, timeout: float) -> None:
    waits = {asyncio.ensure_future(a.wait()), asyncio.ensure_future(b.wait())}
    try:
        await asyncio.wait(waits, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for w in waits:
            w.cancel()


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

    def __init__(self, nc: _Client, name: str, provider: TracerProvider | None = None) -> None:
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
    ) -> Bus:
        """Connect, retrying until `connect_timeout_s`; once connected, reconnect forever."""

        async def on_disconnect() -> None:
            if not nc_ref or not (nc_ref[0].is_closed or nc_ref[0].is_draining):
                log.warning("bus %s: disconnected from NATS, reconnecting", name)

        async def on_reconnect() -> None:
            log.info("bus %s: reconnected to NATS", name)

        async def on_error(exc: Exception) -> None:
            log.warning("bus %s: %s", name, exc)

        nc_ref: list[NatsClient] = []
        nc = _Client()
        try:
            await asyncio.wait_for(
                nc.connect(
                    url,
                    name=name,
                    connect_timeout=2,
                    allow_reconnect=True,
                    max_reconnect_attempts=-1,
                    reconnect_time_wait=0.5,
                    disconnected_cb=on_disconnect,
                    reconnected_cb=on_reconnect,
                    error_cb=on_error,
                ),
                timeout=connect_timeout_s,
            )
        except (TimeoutError, nats.errors.NoServersError, OSError) as exc:
            raise RetryableError(f"cannot reach NATS at {url}: {exc or type(exc).__name__}") from exc
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

    async def ensure_streams(self, specs: Sequence[StreamSpec] = subjects.STREAMS) -> None:
        """Create or update every stream; safe to call from many starters at once."""
        for spec in specs:
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
                num_replicas=1,
            )
            try:
                await self.js.add_stream(config)
            except nats.js.errors.BadRequestError:
                await self.js.update_stream(config)  # exists with an older configuration

    # --- publish -------------------------------------------------------------------------------------

    async def publish(self, subject: str, event: Message, *, timeout_s: float = 10.0) -> PubAck:
        """Publish to JetStream and wait for the ack. Retries transient failures with the same
        `Nats-Msg-Id`, so a retry never stores a second copy. Raises RetryableError on timeout."""
        headers = tracing.inject({"Nats-Msg-Id": event.event_id})
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

    @staticmethod
    def _consumer_config(spec: ConsumerSpec) -> ConsumerConfig:
        return ConsumerConfig(
            durable_name=spec.durable,
            ack_policy=AckPolicy.EXPLICIT,
            ack_wait=spec.ack_wait_s,
            max_deliver=spec.max_deliver + 1,  # one delivery more than we retry, to dead-letter it
            max_ack_pending=spec.max_ack_pending,
            filter_subject=spec.filter_subject,
            deliver_policy=DeliverPolicy.NEW if spec.deliver_new else DeliverPolicy.ALL,
        )

    async def _pull(self, spec: ConsumerSpec) -> JetStreamContext.PullSubscription:
        config = self._consumer_config(spec)
        return await self.js.pull_subscribe(
            spec.filter_subject, durable=spec.durable, stream=spec.stream.name, config=config
        )

    async def _fetch(
        self, sub: JetStreamContext.PullSubscription, batch: int, stop: asyncio.Event
    ) -> list[Msg]:
        """Fetch up to `batch` messages, returning early (empty) when `stop` is set."""
        fetch = asyncio.ensure_future(sub.fetch(batch, timeout=5.0))
        stopped = asyncio.ensure_future(stop.wait())
        try:
            await asyncio.wait({fetch, stopped}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            stopped.cancel()
        if not fetch.done():
            fetch.cancel()
            with contextlib.suppress(asyncio.CancelledError, *_TRANSIENT):
                await fetch
            return []
        try:
            return fetch.result()
        except _TRANSIENT:
            return []

    def _delivery(self, msg: Msg) -> Delivery:
        return Delivery.of(self.nc, msg)

    def _decode(self, msg: Msg) -> Message:
        try:
            carries = subjects.CARRIES[subjects.kind_of(msg.subject)]
        except (KeyError, ValueError) as exc:
            raise MalformedMessage(f"subject {msg.subject!r} is not in the registry") from exc
        return decode(msg.data, carries)

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
            payload=delivery.data.decode("utf-8", errors="replace")[:100_000],
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
        self, spec: ConsumerSpec, handler: Handler, stop: asyncio.Event, *, batch: int = 64
    ) -> None:
        """Run `handler` on each message until `stop` is set; ack after it returns."""
        sub = await self._pull(spec)
        try:
            while not stop.is_set():
                for msg in await self._fetch(sub, batch, stop):
                    delivery = self._delivery(msg)
                    try:
                        event = self._decode(msg)
                    except MalformedMessage as exc:
                        await self._fail(spec, delivery, exc)
                        continue
                    with self._tracer.start_as_current_span(
                        f"consume {spec.durable}",
                        context=delivery.trace_context,
                        kind=trace.SpanKind.CONSUMER,
                    ):
                        try:
                            await handler(event, delivery)
                        except asyncio.CancelledError:
                            raise
                        except Exception as exc:
                            await self._fail(spec, delivery, exc)
                        else:
                            await msg.ack()
        finally:
            with contextlib.suppress(Exception):
                await sub.unsubscribe()

    async def consume_batches(
        self,
        spec: ConsumerSpec,
        handler: BatchHandler,
        stop: asyncio.Event,
        *,
        max_batch: int = 500,
        max_wait_s: float = 0.02,
    ) -> None:
        """Run `handler` on batches of messages (as many as are waiting, up to `max_batch`, after
        `max_wait_s` for a burst to gather) until `stop` is set.

        Every message of a batch is acked after the handler returns (explicit acks, sent in one
        write), or nak'd / dead-lettered one by one if it raises; a malformed message is terminated
        and dead-lettered and never reaches the handler. Handlers run one at a time, in stream
        order; while one runs, the next batch is received and decoded (a pipeline of two).
        """
        await self._ensure_consumer(spec)
        sub = await self.nc.subscribe(self.nc.new_inbox())
        puller = _Puller(self.nc, spec, sub.subject, max_batch)
        self.nc.sinks[sub._id] = puller
        carries: dict[bytes, tuple[type[Message], ...]] = {}
        running: asyncio.Task[None] | None = None
        running_batch: list[tuple[Message, Delivery]] = []
        ready: list[tuple[Message, Delivery]] = []
        try:
            while not stop.is_set():
                if running is not None and not puller.items:  # nothing to overlap with: settle it now
                    await self._settle(spec, running, running_batch)
                    running = None
                for i, (subject, reply, data, headers) in enumerate(
                    await puller.take(max_batch, max_wait_s, stop)
                ):
                    if running is not None and i % 200 == 0:
                        await asyncio.sleep(0)  # let the handler take its next step (its I/O overlaps this)
                    delivery = Delivery(self.nc, subject.decode(), reply, data, headers)
                    try:
                        types = carries.get(subject) or self._carries(subject, carries)
                        ready.append((_decode_as(data, types), delivery))
                    except MalformedMessage as exc:
                        await self._fail(spec, delivery, exc)
                if running is not None:
                    await self._settle(spec, running, running_batch)
                    running = None
                if ready and not stop.is_set():
                    running_batch, ready = ready, []
                    running = asyncio.ensure_future(handler(running_batch))
            if running is not None:
                await self._settle(spec, running, running_batch)
                running = None
            # Decoded or delivered but not handled: back to the stream now, not after the ack wait.
            with contextlib.suppress(Exception):
                await self.nc.send_acks([d.reply for _, d in ready] + [m[1] for m in puller.items], b"-NAK")
        finally:
            if running is not None:  # cancelled: the batch in flight is not acked
                running.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await running
            self.nc.sinks.pop(sub._id, None)
            with contextlib.suppress(Exception):
                await sub.unsubscribe()

    async def _settle(
        self, spec: ConsumerSpec, running: asyncio.Future[None], batch: list[tuple[Message, Delivery]]
    ) -> None:
        """Wait for a batch's handler; ack its messages if it returned, nak or dead-letter them if not."""
        try:
            await asyncio.shield(running)  # a cancel of the consumer cancels the handler in `finally`
        except asyncio.CancelledError:
            if running.cancelled():
                raise RuntimeError("a batch handler was cancelled") from None
            raise
        except Exception as exc:
            for _, delivery in batch:
                await self._fail(spec, delivery, exc)
        else:
            await self.nc.send_acks([delivery.reply for _, delivery in batch])

    async def _ensure_consumer(self, spec: ConsumerSpec) -> None:
        """Create the durable pull consumer unless it exists."""
        try:
            await self.js.consumer_info(spec.stream.name, spec.durable)
        except nats.js.errors.NotFoundError:
            await self.js.add_consumer(spec.stream.name, self._consumer_config(spec))

    @staticmethod
    def _carries(subject: bytes, cache: dict[bytes, tuple[type[Message], ...]]) -> tuple[type[Message], ...]:
        try:
            types = subjects.CARRIES[subjects.kind_of(subject.decode())]
        except (KeyError, ValueError, UnicodeDecodeError) as exc:
            raise MalformedMessage(f"subject {subject!r} is not in the registry") from exc
        if len(cache) > 10_000:  # a subject per job: keep the cache bounded
            cache.clear()
        cache[subject] = types
        return types

    # --- watch -----------------------------------------------------------------------------------------

    @contextlib.asynccontextmanager
    async def watch(
        self, *filter_subjects: str, from_start: bool = False
    ) -> AsyncIterator[AsyncIterator[Message]]:
        """Ephemeral ordered consumers of `filter_subjects` (new messages, or all with `from_start`).

        Usage: `async with bus.watch(subjects.ALL_INCIDENTS) as events: async for event in events: ...`
        Malformed messages are logged and skipped (nothing durable depends on a watcher).
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

            yield EventStream(queue, self._decode)
        finally:
            for sub in subs:
                with contextlib.suppress(Exception):
                    await sub.unsubscribe()


def _decode_as(data: bytes, types: tuple[type[Message], ...]) -> Message:
    """`decode(data, types)`, straight into the class when the subject carries only one."""
    if len(types) == 1:
        try:  # the validator itself: model_validate_json adds ~1 us of Python around it
            return types[0].__pydantic_validator__.validate_json(data)  # type: ignore[no-any-return]
        except ValidationError:
            pass
    return decode(data, types)  # raises MalformedMessage naming what is wrong
