"""Scanning: the messages stored on a subject since a time, read once through a named pull consumer made
for the scan (a guardian reads a job's history back with it at start)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import AsyncIterator
from datetime import UTC, datetime, timedelta

import nats.errors
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy

from vigil.errors import MalformedMessage, RetryableError
from vigil.events import Message
from vigil_common import subjects
from vigil_common.bus.client import BusClient
from vigil_common.bus.decoding import Admit, admitted
from vigil_common.bus.deliveries import not_delivered_by

log = logging.getLogger(__name__)


class Scanning(BusClient):
    async def scan(
        self,
        name: str,
        filter_subject: str,
        *,
        since: float,
        upto: int | None = None,
        admit: Admit | None = None,
    ) -> AsyncIterator[Message]:
        """The messages stored on `filter_subject` (either form) since `since` (epoch seconds), up to
        stream sequence `upto`, read through the named pull consumer `name` (made for the scan, deleted
        after it). Malformed messages are skipped, and so are a message that consumer did not deliver
        and one `admit` refuses. One scan per name at a time: a scan that finds the name taken (another
        process's scan) waits for it to end."""
        stream = subjects.stream_for(filter_subject).name
        forms = self.reads(filter_subject)
        config = ConsumerConfig(
            name=name,
            deliver_policy=DeliverPolicy.BY_START_TIME,
            opt_start_time=datetime.fromtimestamp(max(since, 0.0), tz=UTC) - timedelta(seconds=1),
            ack_policy=AckPolicy.NONE,
            filter_subject=forms[0] if len(forms) == 1 else None,
            filter_subjects=list(forms) if len(forms) > 1 else None,
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
                    if not subjects.holds(filter_subject, msg.subject):
                        continue  # stored before VIGIL_JOBS's transform, of another share
                    try:
                        event = await admitted(msg, admit)
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
        subject = f"$JS.API.CONSUMER.CREATE.{stream}.{config.name}"
        if config.filter_subject:
            subject += f".{config.filter_subject}"
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
