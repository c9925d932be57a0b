"""VIGIL_JOBS stores each job event under the share `subjects.share_of` computes (the stream's subject
transform, the NATS server's `partition()`; the guardian loads a share's saved jobs by `share_of`, so the
two must agree), in the order it was published, and a second `ensure_streams` changes nothing."""

from __future__ import annotations

import uuid

import pytest

from tests.unit.guardian.helpers import step
from vigil_common import subjects
from vigil_common.bus import Bus
from vigil_common.embedded import EmbeddedNats

pytestmark = pytest.mark.integration


async def test_the_server_puts_each_job_in_the_share_share_of_names(server_dir) -> None:  # type: ignore[no-untyped-def]
    with EmbeddedNats(server_dir / "nats") as server:
        bus = await Bus.connect(server.url, "test-shares")
        try:
            await bus.ensure_streams()
            assert not bus.legacy_jobs  # a new stream: every message in the stored form
            jobs = [f"j-{uuid.uuid4().hex[:10]}" for _ in range(64)] + ["a", "job-0", "x" * 64]
            for k, job in enumerate(jobs):
                ack = await bus.publish(subjects.step(job, "n1"), step(k, job_id=job))
                assert ack.seq == k + 1
            found = {}
            for seq in range(1, len(jobs) + 1):
                msg = await bus.js.get_msg(subjects.JOBS.name, seq)
                assert msg.subject is not None
                assert msg.subject == subjects.stored(subjects.step(jobs[seq - 1], "n1"))  # in order
                assert subjects.published(msg.subject) == subjects.step(jobs[seq - 1], "n1")
                found[subjects.token_at(msg.subject)] = int(msg.subject.split(".")[2])
            assert found == {job: subjects.share_of(job) for job in jobs}
            assert len(set(found.values())) > subjects.SHARES // 2  # spread over the shares
            for share in range(subjects.SHARES):  # a share's filter holds its jobs' events, and only those
                info = await bus.js.stream_info(
                    subjects.JOBS.name, subjects_filter=subjects.share_events(share)
                )
                held = {subjects.token_at(s) for s in (info.state.subjects or {})}
                assert held == {job for job in jobs if subjects.share_of(job) == share}

            await bus.ensure_streams()  # again: nothing changes, the next step is stored once
            ack = await bus.publish(subjects.step(jobs[0], "n1"), step(99, job_id=jobs[0]))
            assert ack.seq == len(jobs) + 1 and not bus.legacy_jobs
            info = await bus.js.stream_info(subjects.JOBS.name)
            assert info.state.messages == len(jobs) + 1
            names = {i.config.name for i in await bus.js.streams_info()}
            assert names == {spec.name for spec in subjects.STREAMS}  # no copy of VIGIL_JOBS
        finally:
            await bus.close()
