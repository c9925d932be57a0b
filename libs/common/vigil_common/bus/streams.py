"""The streams: made and kept to their declared shape (`subjects.STREAMS`), and read one stored message
at a time (no consumer)."""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, datetime

import nats.js.errors
from nats.js.api import DiscardPolicy, RawStreamMsg, StorageType, StreamConfig, StreamSource, SubjectTransform

from vigil_common import subjects
from vigil_common.bus.client import BusClient, unanswered
from vigil_common.subjects import StreamSpec


@dataclass(frozen=True)
class Stored:
    """A message read from a stream: where it is stored, and what (its `Nats-Msg-Id` when it has one)."""

    stream: str
    seq: int
    subject: str
    data: bytes
    msg_id: str | None = None


class Streams(BusClient):
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

    async def next_stored(self, stream: str, subject: str, seq: int) -> Stored | None:
        """The first message `stream` stores on `subject` (a wildcard too) at or after sequence `seq`;
        None when there is none. RetryableError when the server does not answer."""
        with unanswered(f"reading {subject} from {stream}"):
            try:
                raw = await self.js.get_msg(stream, seq=seq, subject=subject, next=True)
            except nats.js.errors.NotFoundError:
                return None
        return _stored(stream, raw)

    async def last_stored(self, stream: str, subject: str) -> Stored | None:
        """The last message `stream` stores on `subject` (a wildcard too); None when there is none.
        RetryableError when the server does not answer."""
        with unanswered(f"reading the last of {subject} from {stream}"):
            try:
                raw = await self.js.get_last_msg(stream, subject)
            except nats.js.errors.NotFoundError:
                return None
        return _stored(stream, raw)


def _stored(stream: str, raw: RawStreamMsg) -> Stored | None:
    if raw.seq is None or raw.subject is None:
        return None
    return Stored(stream, raw.seq, raw.subject, raw.data or b"", (raw.headers or {}).get("Nats-Msg-Id"))


def _source(spec: subjects.SourceSpec) -> StreamSource:
    return StreamSource(
        name=spec.stream,
        opt_start_time=datetime.fromtimestamp(time.time() - spec.backfill_s, tz=UTC),
        subject_transforms=[SubjectTransform(src=spec.src, dest=spec.dest)],
    )
