"""`lease.holders` lists this database's holders only: the server's other databases (another deployment's,
or another test's on the session's server) have guardians and schedulers of their own. Once, a guardian
of another database was read with a NULL `backend_start` and broke a test that compared it."""

from __future__ import annotations

import asyncpg
import pytest

from tests.integration.scheduler.conftest import fresh_database
from vigil_common import lease

pytestmark = pytest.mark.integration


async def test_a_guardian_of_another_database_is_not_a_holder_here(migrated: str, database_url: str) -> None:
    other = await fresh_database(database_url)
    here = await asyncpg.connect(
        migrated, server_settings={"application_name": "vigil-lease-guardian-1@here"}
    )
    there = await asyncpg.connect(other, server_settings={"application_name": "vigil-lease-guardian-2@there"})
    try:
        for conn in (here, there):
            await conn.execute("SELECT pg_advisory_lock($1)", lease.SHARE_KEY)  # share 0, in each database
        found = [h for h in await lease.holders(here) if h.role == "guardian"]
        assert [(h.instance, h.shares) for h in found if h.instance.endswith(("@here", "@there"))] == [
            ("1@here", (0,))
        ]
        assert all(h.since is not None for h in found)
    finally:
        await here.close()
        await there.close()
