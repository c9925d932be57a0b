"""A high-volume durable consumer for step events: push delivery into a buffer, batched writes.

Every rank sends one event per step, so the steps stream is the one stream whose volume matters.
`bus.consume_batches` pulls, handles and acks strictly in turn; here the server pushes into a
buffer (with flow control) while the previous batch is being written, so receiving and writing
overlap. The guarantees are the bus's: a batch is acknowledged only after its write commits;
a failed write is nak'd with back-off and dead-lettered after `max_deliver`; a malformed message
is terminated and recorded on the dead-letter stream; the loop goes on.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable

import nats.js.errors
from nats.aio.msg import Msg
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy
from pydantic import ValidationError

from vigil_common import subjects
from vigil_common.bus import Bus, ConsumerSpec, Delivery
from vigil_common.errors import MalformedMessage, PermanentError
from vigil_common.events import StepCompleted, decode

log = logging.getLogger(__name__)

Writer = Callable[[list[StepCompleted]], Awaitable[None]]


class StepIngest:
    """Consume `spec` (a steps consumer) until `stop`, calling `write` on batches of events."""

    def __init__(
        self, bus: Bus, spec: ConsumerSpec, write: Writer, *, max_batch: int = 2000, max_wait_s: float = 0.02
    ) -> None:
        self.bus = bus
        self.spec = spec
        self.write = write
        self.max_batch = max_batch
        self.max_wait_s = max_wait_s
        self._buffer: list[Msg] = []
        self._arrived = asyncio.Event()
        self.written = 0

    async def _on_msg(self, msg: Msg) -> None:
        self._buffer.append(msg)
        self._arrived.set()

    async def _subscribe(self) -> object:
        spec = self.spec
        config = ConsumerConfig(
            durable_name=spec.durable,
            deliver_subject=self.bus.nc.new_inbox(),
            ack_policy=AckPolicy.EXPLICIT,
            ack_wait=spec.ack_wait_s,
            max_deliver=spec.max_deliver + 1,
            max_ack_pending=spec.max_ack_pending,
            filter_subject=spec.filter_subject,
            deliver_policy=DeliverPolicy.NEW if spec.deliver_new else DeliverPolicy.ALL,
            flow_control=True,
            idle_heartbeat=5.0,
        )
        kwargs = dict(
            durable=spec.durable,
            stream=spec.stream.name,
            cb=self._on_msg,
            manual_ack=True,
            config=config,
            flow_control=True,
            idle_heartbeat=5.0,
            pending_msgs_limit=4 * spec.max_ack_pending,
        )
        try:
            return await self.bus.js.subscribe(spec.filter_subject, **kwargs)
        except nats.js.errors.Error as exc:
            if "push" not in str(exc).lower() and "pull" not in str(exc).lower():
                raise
            # An older pull consumer of this name: replace it. Writes are idempotent, so
            # re-reading what it had already stored adds nothing.
            log.warning("%s: replacing a pull consumer of this name with a push consumer", spec.durable)
            await self.bus.js.delete_consumer(spec.stream.name, spec.durable)
            return await self.bus.js.subscribe(spec.filter_subject, **kwargs)

    async def run(self, stop: asyncio.Event) -> None:
        sub = await self._subscribe()
        stopped = asyncio.ensure_future(stop.wait())
        try:
            while not stop.is_set():
                if not self._buffer:
                    self._arrived.clear()
                    arrived = asyncio.ensure_future(self._arrived.wait())
                    await asyncio.wait({arrived, stopped}, return_when=asyncio.FIRST_COMPLETED)
                    arrived.cancel()
                    if stop.is_set():
                        break
                if len(self._buffer) < self.max_batch:
                    await asyncio.sleep(self.max_wait_s)  # let a burst gather into one batch
                batch, self._buffer = self._buffer[: self.max_batch], self._buffer[self.max_batch :]
                await self._handle(batch)
        finally:
            stopped.cancel()
            with contextlib.suppress(Exception):
                await sub.unsubscribe()  # type: ignore[attr-defined]

    async def _handle(self, batch: list[Msg]) -> None:
        events: list[StepCompleted] = []
        good: list[Msg] = []
        for msg in batch:
            try:
                events.append(_decode_step(msg.data))
                good.append(msg)
            except MalformedMessage as exc:
                await self._fail(msg, exc)
        if not events:
            return
        try:
            await self.write(events)
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            for msg in good:
                await self._fail(msg, exc)
            return
        for msg in good:
            await msg.ack()
        self.written += len(good)

    async def _fail(self, msg: Msg, exc: BaseException) -> None:
        """As the bus does: terminate and dead-letter permanent failures, nak transient ones with back-off."""
        delivery = Delivery(
            msg=msg,
            subject=msg.subject,
            headers=dict(msg.headers or {}),
            num_delivered=msg.metadata.num_delivered,
            stream_seq=msg.metadata.sequence.stream,
        )
        if isinstance(exc, PermanentError) or delivery.num_delivered >= self.spec.max_deliver:
            await self.bus.dead_letter(self.spec, delivery, f"{type(exc).__name__}: {exc}")
            await msg.term()
        else:
            log.warning(
                "%s: %s #%d failed (delivery %d), retrying: %s",
                self.spec.durable,
                msg.subject,
                delivery.stream_seq,
                delivery.num_delivered,
                exc,
            )
            await msg.nak(delay=self.spec.delay(delivery.num_delivered))


def _decode_step(data: bytes) -> StepCompleted:
    """The fast path (pydantic's JSON parser straight into the model), or the bus's error message."""
    try:
        return StepCompleted.model_validate_json(data)
    except ValidationError:
        event = decode(data, subjects.CARRIES["step"])  # raises MalformedMessage naming the problem
        assert isinstance(event, StepCompleted)
        return event
