"""The bus client: a small layer over nats-py JetStream, one module per concept.

- `client`: connect, close, and publish: `Nats-Msg-Id = <subject>|<event_id>` (JetStream drops
  duplicates inside the stream's window: the same event again on the same subject, never a message on
  another subject), waits for the publish ack, retries transient failures with the same id, and carries
  the W3C trace context in headers.
- `streams`: the streams made to their declared shape; a stored message read by its sequence, or the
  last one on a subject.
- `consumers`: named durable push consumers (per message, or in batches), ack after the handler's
  effect, where one stands, deleting one; `deliveries`: what they are given and whether they delivered it.
- `watch`: the stored messages of some subjects, read from their stream one by one (no consumer), for
  the CLI, SSE and the ranks' commands; `scan`: stored messages since a time, through a named consumer;
  `listen`: what is published from now on (core NATS, nothing stored); `presence`: whether a process
  (a node's worker) is still connected, by a request its server answers "no responders" once it is not.
- `objects`: objects of the Object Store buckets (code packages), put, read chunk by chunk, deleted.
- `decoding`: only the types a subject carries, from the stream that stores it, from an admitted origin.

Import what a caller needs from here: `from vigil_common.bus import Bus, ConsumerSpec, Delivery`.
"""

from __future__ import annotations

from vigil_common.bus.client import SENDER_HEADER, msg_id
from vigil_common.bus.consumers import Consumers
from vigil_common.bus.decoding import Admit
from vigil_common.bus.deliveries import (
    BatchHandler,
    ConsumerSpec,
    ConsumerState,
    Delivery,
    Handler,
    not_delivered_by,
)
from vigil_common.bus.listen import Listening
from vigil_common.bus.objects import Objects
from vigil_common.bus.presence import Presence, Presences
from vigil_common.bus.scan import Scanning
from vigil_common.bus.streams import Stored
from vigil_common.bus.watch import EventStream, Watching

__all__ = [
    "SENDER_HEADER",
    "Admit",
    "BatchHandler",
    "Bus",
    "ConsumerSpec",
    "ConsumerState",
    "Delivery",
    "EventStream",
    "Handler",
    "Presence",
    "Stored",
    "msg_id",
    "not_delivered_by",
]


class Bus(Consumers, Watching, Scanning, Listening, Presences, Objects):
    """A connected NATS client with JetStream. Build with `await Bus.connect(url, name)`; close with
    `await bus.close()` (or `async with`)."""
