"""The code bucket under Vigil's NATS users: the scheduler puts, reads and deletes a code package with its
own credential; a worker reads it with its own, and may neither write into the bucket nor purge it."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.integration.secured import refused, secured_nats
from vigil_common import credentials, subjects
from vigil_common.bus import Bus

pytestmark = [pytest.mark.integration, pytest.mark.security]


async def test_the_scheduler_writes_code_packages_and_a_worker_only_reads_them(tmp_path: Path) -> None:
    data = os.urandom(200 * 1024)  # two chunks
    name = "c" * 64
    with secured_nats(tmp_path, ["n1"]) as server:
        scheduler = await Bus.connect(server.url_for(credentials.SCHEDULER), "scheduler")
        worker = await Bus.connect(server.url_for(credentials.worker_role("n1")), "worker-n1")
        try:
            assert await scheduler.put_object(subjects.CODE, name, data)
            assert await worker.get_object(subjects.CODE, name) == data
            role = credentials.worker_role("n1")
            for subject in (subjects.CODE.meta(name), f"$JS.API.STREAM.PURGE.{subjects.CODE.stream}"):
                refusals = await refused(server, role, lambda nc, s=subject: nc.publish(s, b"{}"))
                assert refusals.of("publish", subject), refusals.seen
            assert await scheduler.delete_object(subjects.CODE, name)
        finally:
            await worker.close()
            await scheduler.close()
