"""The streams: made and kept to their declared shape (`subjects.STREAMS`), and read one stored message
at a time (no consumer)."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Sequence
from dataclasses import dataclass

import nats.js.errors
from nats.js.api import DiscardPolicy, RawStreamMsg, StorageType, StreamConfig, SubjectTransform

from vigil_common import credentials, subjects
from vigil_common.bus.client import BusClient, unanswered
from vigil_common.subjects import StreamSpec

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Stored:
    """A message read from a stream: where it is stored, and what (its `Nats-Msg-Id` when it has one)."""

    stream: str
    seq: int
    subject: str
    data: bytes
    msg_id: str | None = None


# VIGIL_JOBS's metadata: the last sequence that may hold a message in the published form (stored before the
# stream had its transform); "0" on a stream created with it. See `subjects.stored`.
LEGACY_THROUGH = "vigil_legacy_through"


class Streams(BusClient):
    async def ensure_streams(
        self, specs: Sequence[StreamSpec] = subjects.STREAMS, *, manage: bool = True, replicas: int = 1
    ) -> None:
        """Create or update every stream, kept on `replicas` servers of a NATS cluster
        (`settings.stream_replicas`); safe to call from many starters at once. Then learn whether
        VIGIL_JOBS still holds messages of the layout before its transform (`legacy_jobs`).

        With `manage=False` (a service whose NATS role may not change streams: see
        `vigil_common.credentials`) a stream that exists is left as it is, and only a missing one is
        created (which a restricted credential is refused: the scheduler or `vigil up` creates them).

        With `manage`, an existing stream is updated to its declared shape, and the streams of an earlier
        release (`subjects.RETIRED_STREAMS`) are deleted. A VIGIL_JOBS made before its subject transform
        is migrated in place: the transform is added (what is stored from then on is in the stored form),
        and its last sequence at that moment is kept in the stream's metadata (`LEGACY_THROUGH`): readers
        read the published form too while the stream still holds a message up to it (`subjects.reads`).
        Nothing is copied and publishing never stops; the old messages go with the stream's retention."""
        for spec in specs:
            if not manage:
                try:
                    await self.js.stream_info(spec.name)
                    continue
                except nats.js.errors.NotFoundError:
                    pass
            config = _config(spec, replicas)
            if spec.transform is not None:
                config.metadata = {LEGACY_THROUGH: "0"}  # a new stream holds nothing of the old layout
            try:
                await self.js.add_stream(config)
            except nats.js.errors.BadRequestError:  # exists with an older configuration
                await self._update(spec, config)
        if manage:
            for name in subjects.RETIRED_STREAMS:
                await self._retire(name)
        if any(spec.name == subjects.JOBS.name for spec in specs):
            self.legacy_jobs = await self._holds_legacy()

    async def _update(self, spec: StreamSpec, config: StreamConfig) -> None:
        config.metadata = None
        if spec.transform is not None:
            old = (await self.js.stream_info(spec.name)).config
            through = (old.metadata or {}).get(LEGACY_THROUGH)
            if through is None:  # the layout before the transform: migrate (see ensure_streams)
                info = await self.js.update_stream(config)
                through = str(info.state.last_seq)
                log.warning(
                    "%s: stores each event under its share from now on; the %d messages up to #%s keep "
                    "their published subjects, read in both forms until the retention drops them",
                    spec.name,
                    info.state.messages,
                    through,
                )
            config.metadata = {LEGACY_THROUGH: through}
        await self.js.update_stream(config)

    async def _retire(self, name: str) -> None:
        """Delete a stream of an earlier release (VIGIL_SHARES, the copy of VIGIL_JOBS by share). No
        service role may delete a stream (`vigil_common.credentials`): the scheduler stops its copying
        (an update without sources) and leaves the deletion to the admin credential (`vigil up` uses it)."""
        try:
            info = await self.js.stream_info(name)
        except nats.js.errors.NotFoundError:
            return
        if self.user in (None, credentials.ADMIN):
            with contextlib.suppress(nats.js.errors.NotFoundError):
                await self.js.delete_stream(name)
            log.warning("deleted the stream %s of an earlier release", name)
            return
        if info.config.sources:
            info.config.sources = None
            await self.js.update_stream(info.config)
        log.warning(
            "the stream %s of an earlier release copies nothing now; delete it with the admin credential "
            "(`nats stream rm %s`, or `vigil up` once)",
            name,
            name,
        )

    async def _holds_legacy(self) -> bool:
        """Whether VIGIL_JOBS may hold a message stored in the published form: it has no transform yet,
        or its first message is at or before `LEGACY_THROUGH` (unknown: it may)."""
        try:
            info = await self.js.stream_info(subjects.JOBS.name)
        except nats.js.errors.NotFoundError:
            return False  # made by its creator with the transform
        through = (info.config.metadata or {}).get(LEGACY_THROUGH)
        if info.config.subject_transform is None or through is None:
            return True
        return info.state.messages > 0 and info.state.first_seq <= int(through)

    async def next_stored(self, stream: str, subject: str, seq: int) -> Stored | None:
        """The first message `stream` stores on `subject` (a wildcard too; either form) at or after
        sequence `seq`; None when there is none. RetryableError when the server does not answer."""
        found = []
        with unanswered(f"reading {subject} from {stream}"):
            for form in self.reads(subject):
                with contextlib.suppress(nats.js.errors.NotFoundError):
                    found.append(await self.js.get_msg(stream, seq=seq, subject=form, next=True))
        return min((m for raw in found if (m := _stored(stream, raw))), key=lambda m: m.seq, default=None)

    async def last_stored(self, stream: str, subject: str) -> Stored | None:
        """The last message `stream` stores on `subject` (a wildcard too; either form); None when there
        is none. RetryableError when the server does not answer."""
        found = []
        with unanswered(f"reading the last of {subject} from {stream}"):
            for form in self.reads(subject):
                with contextlib.suppress(nats.js.errors.NotFoundError):
                    found.append(await self.js.get_last_msg(stream, form))
        return max((m for raw in found if (m := _stored(stream, raw))), key=lambda m: m.seq, default=None)


def _stored(stream: str, raw: RawStreamMsg) -> Stored | None:
    if raw.seq is None or raw.subject is None:
        return None
    return Stored(stream, raw.seq, raw.subject, raw.data or b"", (raw.headers or {}).get("Nats-Msg-Id"))


def _config(spec: StreamSpec, replicas: int) -> StreamConfig:
    return StreamConfig(
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
        subject_transform=SubjectTransform(*spec.transform) if spec.transform is not None else None,
    )
