"""Objects in JetStream Object Store buckets (`subjects.BUCKETS`): put, read, delete, by name.

Putting and deleting go through nats-py's `ObjectStore` (its chunk and metadata layout, its digest). Reading
does not: nats-py reads an object's chunks through an ephemeral ordered consumer, a consumer without a name
that no role's permissions allow (`vigil_common.credentials`). `get_object` reads the metadata's last
message and then each chunk by stream sequence (STREAM.MSG.GET, one request per 128 KiB chunk), what a
role allowed to read the bucket's stream may do and nothing more.
"""

from __future__ import annotations

import contextlib
import json

import nats.js.errors
from nats.js.api import ObjectInfo, ObjectStoreConfig, StorageType
from nats.js.object_store import ObjectStore

from vigil.errors import NotFound, RetryableError
from vigil_common.bus.client import BusClient, unanswered
from vigil_common.subjects import BucketSpec


class Objects(BusClient):
    _buckets: dict[str, ObjectStore]

    async def _bucket(self, spec: BucketSpec, replicas: int) -> ObjectStore:
        """The bucket, made with its declared shape the first time this connection puts into it."""
        if not hasattr(self, "_buckets"):
            self._buckets = {}
        if spec.name not in self._buckets:
            config = ObjectStoreConfig(
                description=spec.description,
                max_bytes=spec.max_bytes,
                storage=StorageType.FILE,
                replicas=replicas,
            )
            with unanswered(f"making the bucket {spec.name}"):
                try:
                    self._buckets[spec.name] = await self.js.create_object_store(spec.name, config)
                except nats.js.errors.BadRequestError:  # made before, with another shape: use it as it is
                    self._buckets[spec.name] = await self.js.object_store(spec.name)
        return self._buckets[spec.name]

    async def has_object(self, spec: BucketSpec, name: str) -> bool:
        return await self._info(spec, name) is not None

    async def put_object(self, spec: BucketSpec, name: str, data: bytes, *, replicas: int = 1) -> bool:
        """Store `data` as `name` unless an object of that name is there already (names are content
        hashes: the same name is the same bytes). True when it was stored now."""
        store = await self._bucket(spec, replicas)
        if await self.has_object(spec, name):
            return False
        with unanswered(f"storing {name} in {spec.name}"):
            await store.put(name, data)
        return True

    async def get_object(self, spec: BucketSpec, name: str) -> bytes:
        """The bytes of the object `name`: NotFound when the bucket has none (or it was deleted),
        RetryableError when the server does not answer or the object is cut short."""
        info = await self._info(spec, name)
        if info is None or not info.nuid:
            raise NotFound(f"{spec.name} holds no object {name}")
        subject, size = spec.chunks(info.nuid), info.size or 0
        parts: list[bytes] = []
        got, seq = 0, 1
        with unanswered(f"reading {name} from {spec.name}"):
            while got < size:
                try:
                    msg = await self.js.get_msg(spec.stream, seq=seq, subject=subject, next=True)
                except nats.js.errors.NotFoundError:
                    raise RetryableError(f"{spec.name}: {name} ends after {got} of {size} bytes") from None
                parts.append(msg.data or b"")
                got += len(msg.data or b"")
                seq = (msg.seq or seq) + 1
        return b"".join(parts)

    async def delete_object(self, spec: BucketSpec, name: str, *, replicas: int = 1) -> bool:
        """The object `name` deleted (its chunks purged); False when there was none."""
        store = await self._bucket(spec, replicas)
        with unanswered(f"deleting {name} from {spec.name}"):
            try:
                await store.delete(name)
            except nats.js.errors.ObjectNotFoundError:
                return False
        return True

    async def _info(self, spec: BucketSpec, name: str) -> ObjectInfo | None:
        with unanswered(f"reading {name}'s metadata from {spec.name}"):
            try:
                raw = await self.js.get_last_msg(spec.stream, spec.meta(name))
            except nats.js.errors.NotFoundError:  # no such object, or no bucket yet
                return None
        info = None
        with contextlib.suppress(ValueError, TypeError, KeyError):
            info = ObjectInfo.from_response(json.loads(raw.data or b"{}"))
        return None if info is None or info.deleted else info
