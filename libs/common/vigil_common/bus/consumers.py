"""Named durable push consumers: per message (`consume`) or in batches (`consume_batches`).

Ack only after the handler's effect is done; nak with back-off on transient errors; term and
dead-letter malformed messages, and go on. A message that its consumer did not deliver (its ack subject
names another stream or consumer, or none) is dropped and logged, never acted on.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime
from typing import Any

import nats.js.errors
from nats.aio.msg import Msg
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy
from opentelemetry import trace

from vigil.errors import PermanentError, RejectedEvents
from vigil.events import Message, MessageDeadLettered
from vigil_common import subjects
from vigil_common.bus.client import BusClient, unanswered
from vigil_common.bus.decoding import Admit, admitted
from vigil_common.bus.deliveries import (
    BatchHandler,
    ConsumerSpec,
    ConsumerState,
    Delivery,
    Handler,
    not_delivered_by,
)

log = logging.getLogger(__name__)

# Whether a subject is in a consumer's filter, computed once per (filter, subject): subjects repeat.
_in_filter = functools.lru_cache(maxsize=65_536)(subjects.holds)
Batch = list[tuple[Message, Delivery]]
# Messages decoded between two yields to the event loop (`Consumers._decoded`): under a millisecond, so
# that the batch being written meanwhile waits no longer than that at each of its round trips.
_YIELD_EVERY = 50


class Consumers(BusClient):
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
            if await self._foreign(spec, msg):
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
        acked after the handler returns, or nak'd (dead-lettered past `max_deliver`) if it raises;
        a handler that raises `RejectedEvents` stored the rest: those named are dead-lettered at once
        and the others acked. A message `admit` refuses is dead-lettered as forged and left out of its
        batch. Batches reach the handler one at a time, in the order delivered.

        For volume (every rank's every step): the server pushes into a buffer (at most
        `max_ack_pending` unacknowledged) while the previous batch is being handled, the next batch
        is decoded then too, and a batch's acks go out while the next one is handled: receiving,
        decoding, acknowledging and the handler's writes overlap. A batch that is not full waits
        `gather_s` for a burst. A batch with nothing behind it is handled at once, in this task (no
        hand-over: a lone message's latency is what matters then).
        """
        buffer: list[Msg] = []
        wake = asyncio.Event()  # a message arrived, or `stop` was set: one future to wait on, no task

        async def on_msg(msg: Msg) -> None:
            if not await self._foreign(spec, msg):
                buffer.append(msg)
                wake.set()

        async def on_stop() -> None:
            await stop.wait()
            wake.set()

        sub = await self._push(spec, on_msg)
        stopping = asyncio.create_task(on_stop())
        # the previous batch, handed over: its handler's task (what it raised, if it did) and the batch
        handling: tuple[asyncio.Task[Exception | None], Batch] | None = None
        try:
            while not stop.is_set():
                if not buffer:
                    wake.clear()
                    await wake.wait()
                    continue
                if len(buffer) < max_batch and gather_s > 0:
                    await asyncio.sleep(gather_s)  # let a burst gather into one batch
                batch, buffer[:] = buffer[:max_batch], buffer[max_batch:]
                good = await self._decoded(spec, batch, admit)  # while the previous one is handled
                written = None
                if handling is not None:
                    task, previous = handling
                    handling = None
                    written = (previous, await task)
                if good and buffer:  # more behind it: hand it over, and decode those meanwhile
                    handling = (asyncio.create_task(self._handled(handler, good)), good)
                if written is not None:  # acked while the next batch is being written
                    await self._settle(spec, *written)
                if good and handling is None:  # nothing behind it: handled here, at once
                    await self._settle(spec, good, await self._handled(handler, good))
        finally:
            stopping.cancel()
            if handling is not None:  # stopped: its handler finishes and it is acked; cancelled: neither
                task, previous = handling
                if asyncio.current_task().cancelling():  # type: ignore[union-attr]
                    task.cancel()
                with contextlib.suppress(Exception, asyncio.CancelledError):
                    await self._settle(spec, previous, await task)
            with contextlib.suppress(Exception):
                await sub.unsubscribe()
                for msg in buffer:  # received but not handled: back to the server at once
                    await msg.nak()

    async def consumer_state(self, spec: ConsumerSpec) -> ConsumerState | None:
        """Where `spec`'s durable consumer stands; None when it does not exist. RetryableError when the
        server does not answer."""
        with unanswered(f"the state of consumer {spec.durable}"):
            try:
                info = await self.js.consumer_info(spec.stream.name, spec.durable)
            except nats.js.errors.NotFoundError:
                return None
        return ConsumerState(
            pending=info.num_pending or 0,
            ack_pending=info.num_ack_pending or 0,
            acked=info.ack_floor.stream_seq if info.ack_floor else 0,
        )

    async def delete_consumer(self, stream: str, name: str) -> bool:
        """Delete the consumer `name` of `stream`; False when there is none. RetryableError when the
        server does not answer."""
        with unanswered(f"deleting consumer {name} of {stream}"):
            try:
                await self.js.delete_consumer(stream, name)
            except nats.js.errors.NotFoundError:
                return False
        return True

    async def dead_letter(self, spec: ConsumerSpec, delivery: Delivery, reason: str) -> None:
        """Record a terminated message on the dead-letter stream (idempotent per stream sequence)."""
        log.error(
            "%s: dead-lettering %s #%d: %s", spec.durable, delivery.subject, delivery.stream_seq, reason
        )
        event = MessageDeadLettered(
            event_id=f"dl-{spec.stream.name}-{spec.durable}-{delivery.stream_seq}",
            stream=spec.stream.name,
            consumer=spec.durable,
            subject=subjects.published(delivery.subject),  # as published, whatever the layout stored
            reason=reason[:4000],
            payload=delivery.msg.data.decode("utf-8", errors="replace")[:100_000],
            num_delivered=delivery.num_delivered,
        )
        await self.publish(subjects.dead_letter(spec.stream.name), event)

    # --- the subscription ------------------------------------------------------------------------------

    async def _push(self, spec: ConsumerSpec, on_msg: Callable[[Msg], Awaitable[None]]) -> Any:
        forms = self.reads(spec.filter_subject)  # the stored form (and the published one, see subjects)
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
            filter_subject=forms[0] if len(forms) == 1 else None,
            filter_subjects=list(forms) if len(forms) > 1 else None,
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
                    forms[0],
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
        outside this connection's inboxes, or filtering other subjects: VIGIL_JOBS's layout before its
        transform) cannot be bound as it is now: it is replaced by one that starts after the old one's
        acknowledged messages."""
        try:
            info = await self.js.consumer_info(spec.stream.name, spec.durable)
        except nats.js.errors.NotFoundError:
            return
        shared = bool(info.config.deliver_group)
        # delivered into another prefix's inbox (`_INBOX.`, before each role had its own), which this
        # connection may not read
        inbox = (info.config.deliver_subject or "").startswith(f"{self.inbox_prefix}.")
        filters = sorted(info.config.filter_subjects or [info.config.filter_subject or ""])
        same_filters = filters == sorted(config.filter_subjects or [config.filter_subject or ""])
        same_shape = shared == spec.shared and info.config.max_ack_pending == spec.max_ack_pending
        if same_shape and inbox and same_filters:
            return
        start = info.ack_floor.stream_seq + 1 if info.ack_floor else 1
        log.warning(
            "%s: replacing the durable consumer (shared: %s -> %s, deliver subject %s, filters %s), from #%d",
            spec.durable,
            shared,
            spec.shared,
            info.config.deliver_subject,
            filters,
            start,
        )
        with contextlib.suppress(nats.js.errors.NotFoundError):
            await self.js.delete_consumer(spec.stream.name, spec.durable)
        config.deliver_policy = DeliverPolicy.BY_START_SEQUENCE
        config.opt_start_seq = start

    async def _foreign(self, spec: ConsumerSpec, msg: Msg) -> bool:
        """True (and logged) when `msg` was not delivered by `spec`'s consumer: pushed into its inbox by
        someone else, or delivered by another consumer (a forged or replayed delivery). Such a message
        is never acted on, acknowledged or dead-lettered: it is not this consumer's to settle. A legacy
        message of another share (`subjects.reads`) is acknowledged and skipped."""
        why = not_delivered_by(msg, spec.stream.name, spec.durable)
        if why is None and not _in_filter(spec.filter_subject, msg.subject):
            if any(subjects.matches(form, msg.subject) for form in self.reads(spec.filter_subject)):
                # Stored before VIGIL_JOBS's transform, of another share (a share's filter in the
                # published form is every job's): acknowledged, another share's consumer acts on it.
                await msg.ack()
                return True
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

    # --- handling: ack after the effect, nak or dead-letter on failure -----------------------------------

    async def _handle_one(self, spec: ConsumerSpec, msg: Msg, handler: Handler, admit: Admit | None) -> None:
        delivery = Delivery(msg)
        try:
            event = await admitted(msg, admit)
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

    async def _decoded(self, spec: ConsumerSpec, batch: list[Msg], admit: Admit | None) -> Batch:
        """The batch's events that decode and are admitted; the others are dead-lettered (or nak'd, when
        the check itself failed). Yields now and then, so that a batch being handled meanwhile goes on."""
        good: Batch = []
        for i, msg in enumerate(batch, start=1):
            delivery = Delivery(msg)
            try:
                good.append((await admitted(msg, admit), delivery))
            except Exception as exc:  # malformed or forged: dead-lettered; a failed check: retried
                await self._fail(spec, delivery, exc)
            if i % _YIELD_EVERY == 0:
                await asyncio.sleep(0)  # let the previous batch's handler read its database's answer
        return good

    @staticmethod
    async def _handled(handler: BatchHandler, good: Batch) -> Exception | None:
        """Run the handler on a decoded batch; what it raised, None when it returned."""
        try:
            await handler(good)
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            return exc
        return None

    async def _settle(self, spec: ConsumerSpec, good: Batch, failed: Exception | None) -> None:
        """After its handler: ack the batch, or dead-letter the rejected (and ack the rest), or nak it."""
        if isinstance(failed, RejectedEvents):  # the handler stored the rest: only those are dead letters
            for _, delivery in good:
                if (reason := failed.reasons.get(delivery.stream_seq)) is not None:
                    await self.dead_letter(spec, delivery, reason)
                    await delivery.msg.term()
                else:
                    await delivery.msg.ack()
        elif failed is not None:
            for _, delivery in good:
                await self._fail(spec, delivery, failed)
        else:
            for _, delivery in good:
                await delivery.msg.ack()

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
