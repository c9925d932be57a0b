"""The bus's connection and publishing: what every other part of the bus builds on.

A connection's inboxes are its NATS user's (`_INBOX_<user>`): with the roles' permissions
(`vigil_common.credentials`) no other credential may read them or publish into them.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import ssl
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Self
from urllib.parse import unquote, urlsplit

import nats
import nats.errors
import nats.js.errors
from nats.aio.client import Client as NatsClient
from nats.js import JetStreamContext
from nats.js.api import PubAck
from opentelemetry.sdk.trace import TracerProvider

from vigil.errors import PublishRefused, RetryableError
from vigil.events import Message
from vigil_common import credentials, subjects, tracing
from vigil_common.redact import redact_text, redact_url

log = logging.getLogger(__name__)

# The publishing connection's name (`Bus.connect(url, name)`), for the audit record of commands. Only
# roles allowed to publish a subject can publish there at all (see vigil_common.credentials).
SENDER_HEADER = "Vigil-Service"

TRANSIENT = (
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


@contextlib.contextmanager
def unanswered(what: str) -> Iterator[None]:
    """A request to the server that fails (no answer, no connection, an error reply) raises a
    RetryableError saying `what` failed. A caller handles the answers it expects (NotFoundError) inside."""
    try:
        yield
    except (*TRANSIENT, nats.errors.Error, nats.js.errors.Error) as exc:
        raise RetryableError(f"{what}: {exc!r}") from exc


class BusClient:
    """A connected NATS client with JetStream, and publishing. `Bus` adds streams, consumers, watching,
    listening and scans; build it with `await Bus.connect(url, name)`."""

    # VIGIL_JOBS may hold messages stored in the published form: read both until `ensure_streams` knows
    legacy_jobs: bool = True

    def __init__(
        self, nc: NatsClient, name: str, provider: TracerProvider | None = None, user: str | None = None
    ) -> None:
        self.nc = nc
        self.js: JetStreamContext = nc.jetstream()
        self.name = name
        self.user = user  # the NATS user (role) this connection logged in as; None: anonymous
        self.inbox_prefix = credentials.inbox_prefix(user)
        self._tracer = tracing.tracer(provider, "vigil.bus")
        self._sending = asyncio.Lock()  # `publish_pipelined`: one message handed to the connection at a time

    def reads(self, pattern: str) -> tuple[str, ...]:
        """The filter subjects that read `pattern` (either form) from its stream: `subjects.reads`."""
        return subjects.reads(pattern, legacy=self.legacy_jobs)

    @classmethod
    async def connect(
        cls,
        url: str,
        name: str,
        *,
        provider: TracerProvider | None = None,
        connect_timeout_s: float = 10.0,
        tls_ca: Path | None = None,
    ) -> Self:
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

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def publish(self, subject: str, event: Message, *, timeout_s: float = 10.0) -> PubAck:
        """Publish to JetStream and wait for the ack. Retries transient failures with the same
        `Nats-Msg-Id`, so a retry never stores a second copy. Raises RetryableError on timeout, and
        PublishRefused when the server refuses the message for good (too large, a bad subject)."""
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
                # e.g. a full stream with discard=new, a message over the stream's max_msg_size:
                # permanent for this message, never silent.
                raise PublishRefused(f"publish to {subject} refused: {exc.description}") from exc
            except nats.errors.MaxPayloadError as exc:  # over the server's max_payload: never sent
                raise PublishRefused(
                    f"publish to {subject} refused: {len(payload)} bytes is over the server's max_payload"
                ) from exc
            except nats.errors.BadSubjectError as exc:
                raise PublishRefused(f"publish to {subject!r} refused: not a valid subject") from exc
            except TRANSIENT as exc:
                if time.monotonic() + delay >= deadline:
                    raise RetryableError(f"publish to {subject} not acknowledged in {timeout_s}s") from exc
            await asyncio.sleep(delay)  # back-off between retries, not synchronisation
            delay = min(delay * 2, 1.0)

    async def publish_pipelined(
        self, subject: str, event: Message, *, timeout_s: float = 10.0
    ) -> asyncio.Future[PubAck]:
        """Hand the message to the connection now and return its acknowledgement, to await later: many
        can be in flight. Messages handed over one after the other reach the server in that order on
        this connection, and it stores them in that order. Awaiting the acknowledgement raises what
        `publish` raises; a message the server did not answer in time is sent again with the same
        `Nats-Msg-Id` (stored once, though perhaps after one handed over later: a publisher that needs
        an order across a failure awaits the acknowledgement before it sends on)."""
        headers = tracing.inject({"Nats-Msg-Id": msg_id(subject, event.event_id), SENDER_HEADER: self.name})
        payload = event.to_bytes()
        deadline = time.monotonic() + timeout_s
        try:
            async with self._sending:
                pending = await self.js.publish_async(subject, payload, headers=headers, wait_stall=timeout_s)
        except nats.errors.MaxPayloadError as exc:
            raise PublishRefused(
                f"publish to {subject} refused: {len(payload)} bytes is over the server's max_payload"
            ) from exc
        except nats.errors.BadSubjectError as exc:
            raise PublishRefused(f"publish to {subject!r} refused: not a valid subject") from exc
        except (*TRANSIENT, nats.js.errors.TooManyStalledMsgsError, nats.errors.ConnectionReconnectingError):
            return asyncio.ensure_future(self.publish(subject, event, timeout_s=timeout_s))
        return asyncio.ensure_future(self._acknowledged(subject, event, pending, deadline))

    async def _acknowledged(
        self, subject: str, event: Message, pending: asyncio.Future[PubAck], deadline: float
    ) -> PubAck:
        try:
            return await asyncio.wait_for(pending, max(0.1, deadline - time.monotonic()))
        except nats.js.errors.ServiceUnavailableError:
            pass
        except nats.js.errors.APIError as exc:
            raise PublishRefused(f"publish to {subject} refused: {exc.description}") from exc
        except TRANSIENT:
            pass
        return await self.publish(subject, event, timeout_s=max(0.1, deadline - time.monotonic()))


def _user(url: str) -> str | None:
    """The NATS user a URL names with a password (the first server's, for a list), or None. A user
    without a password is a token (`nats://<token>@host`), never taken for a name."""
    parts = urlsplit(url.split(",")[0].strip())
    return unquote(parts.username) if parts.username and parts.password is not None else None
