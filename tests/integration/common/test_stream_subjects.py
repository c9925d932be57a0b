"""A deployment whose VIGIL_JOBS stream was made before step and status subjects named their origin is
moved to the new subjects at start (a stream update), and takes the new subjects from then on."""

from __future__ import annotations

import pytest
from nats.js.api import StreamConfig

from tests.unit.guardian.helpers import step
from vigil_common import subjects
from vigil_common.bus import Bus
from vigil_common.embedded import EmbeddedNats

pytestmark = pytest.mark.integration

OLD_SUBJECTS = [f"{subjects.PREFIX}.job.*.{kind}" for kind in ("launch", "status", "step")]


async def test_an_existing_jobs_stream_is_updated_to_the_node_scoped_subjects(server_dir):
    with EmbeddedNats(server_dir / "nats") as server:
        bus = await Bus.connect(server.url, "test-stream-subjects")
        try:
            await bus.js.add_stream(StreamConfig(name=subjects.JOBS.name, subjects=OLD_SUBJECTS))
            await bus.ensure_streams()
            info = await bus.js.stream_info(subjects.JOBS.name)
            assert sorted(info.config.subjects or []) == sorted(subjects.JOBS.subjects)
            ack = await bus.publish(subjects.step("j1", "n1"), step(1, job_id="j1"))
            assert ack.stream == subjects.JOBS.name
            await bus.ensure_streams()  # again: nothing to change
        finally:
            await bus.close()
