"""What a durable consumer is (`ConsumerSpec`), what its handler is given (`Delivery`), where it stands
(`ConsumerState`), and whether a message was delivered by it at all (`not_delivered_by`)."""

from __future__ import annotations

import functools
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from nats.aio.msg import Msg
from opentelemetry import context as otel_context

from vigil.events import Message
from vigil_common import subjects, tracing
from vigil_common.subjects import StreamSpec

Handler = Callable[[Message, "Delivery"], Awaitable[None]]
BatchHandler = Callable[[list[tuple[Message, "Delivery"]]], Awaitable[None]]


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


@dataclass(frozen=True)
class ConsumerState:
    """Where a durable consumer stands (`Bus.consumer_state`)."""

    pending: int  # stored on its filter, not delivered yet
    ack_pending: int  # delivered, not acknowledged yet
    acked: int  # the stream sequence up to which every message is acknowledged (its ack floor)

    @property
    def idle(self) -> bool:
        """Nothing to deliver, nothing awaiting its acknowledgement."""
        return self.pending == 0 and self.ack_pending == 0


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
