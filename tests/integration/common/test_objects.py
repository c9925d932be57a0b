"""Objects of the Object Store buckets through the bus (`vigil_common.bus.objects`), on a real NATS: a put
is read back byte for byte chunk by chunk (no consumer), the same name is stored once, a deleted object is
gone."""

from __future__ import annotations

import os
import uuid

import pytest

from vigil.errors import NotFound
from vigil_common.bus import Bus
from vigil_common.subjects import BucketSpec

pytestmark = pytest.mark.integration


async def test_an_object_is_put_read_back_stored_once_and_deleted(bus: Bus) -> None:
    bucket = BucketSpec(name=f"TEST_{uuid.uuid4().hex[:8]}", max_bytes=64 * 1024 * 1024)
    data = os.urandom(300 * 1024 + 7)  # three chunks of 128 KiB, the last one short
    try:
        assert await bus.put_object(bucket, "a" * 64, data)
        assert not await bus.put_object(bucket, "a" * 64, data)  # there already: not stored again
        assert await bus.get_object(bucket, "a" * 64) == data
        assert await bus.put_object(bucket, "b" * 64, b"small")
        assert await bus.get_object(bucket, "b" * 64) == b"small"
        assert await bus.delete_object(bucket, "a" * 64)
        with pytest.raises(NotFound):
            await bus.get_object(bucket, "a" * 64)
        assert not await bus.delete_object(bucket, "a" * 64)
        assert await bus.get_object(bucket, "b" * 64) == b"small"
    finally:
        await bus.js.delete_stream(bucket.stream)
