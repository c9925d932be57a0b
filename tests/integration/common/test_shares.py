"""VIGIL_SHARES: the NATS server copies each job event onto the share `subjects.share_of` computes (the
guardian loads a share's saved jobs by that function, so the two must agree), in VIGIL_JOBS's order, and
a second `ensure_streams` keeps the copy where it stands."""

from __future__ import annotations

import uuid

import pytest

from tests.helpers import eventually
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
            jobs = [f"j-{uuid.uuid4().hex[:10]}" for _ in range(64)] + ["a", "job-0", "x" * 64]
            for k, job in enumerate(jobs):
                await bus.publish(subjects.step(job, "n1"), step(k, job_id=job))

            async def copied() -> bool:
                return (await bus.js.stream_info(subjects.SHARED.name)).state.messages == len(jobs)

            await eventually(copied, what="every step copied into VIGIL_SHARES")
            found = {}
            for seq in range(1, len(jobs) + 1):
                msg = await bus.js.get_msg(subjects.SHARED.name, seq)
                assert msg.subject is not None
                share = int(msg.subject.split(".")[2])
                found[subjects.token_at(msg.subject)] = share
                assert subjects.unshared(msg.subject) == subjects.step(jobs[seq - 1], "n1")  # in order
            assert found == {job: subjects.share_of(job) for job in jobs}
            assert len(set(found.values())) > subjects.SHARES // 2  # spread over the shares

            await bus.ensure_streams()  # again: the copy goes on from where it stands, nothing twice
            await bus.publish(subjects.step(jobs[0], "n1"), step(99, job_id=jobs[0]))
            await eventually(
                lambda: _messages(bus, len(jobs) + 1), what="the next step copied once after the update"
            )
        finally:
            await bus.close()


async def _messages(bus: Bus, n: int) -> bool:
    count = (await bus.js.stream_info(subjects.SHARED.name)).state.messages
    assert count <= n, f"{count} messages in VIGIL_SHARES, {n} published: some copied twice"
    return count == n
