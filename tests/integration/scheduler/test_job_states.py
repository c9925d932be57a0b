"""The database's job states are the enum's: every CHECK on a state column lists exactly JobState."""

from __future__ import annotations

import re

import asyncpg
import pytest

from vigil.jobstates import JobState

pytestmark = pytest.mark.integration


async def test_state_columns_allow_exactly_the_enum(db_url: str) -> None:
    conn = await asyncpg.connect(db_url)
    try:
        rows = await conn.fetch(
            """SELECT c.conrelid::regclass::text AS tab, a.attname AS col, pg_get_constraintdef(c.oid) AS def
               FROM pg_constraint c JOIN pg_attribute a ON a.attrelid = c.conrelid AND a.attnum = ANY(c.conkey)
               WHERE c.contype = 'c' AND a.attname LIKE '%state'"""
        )
        allowed = {f"{r['tab']}.{r['col']}": set(re.findall(r"'([A-Z_]+)'", r["def"])) for r in rows}
        assert set(allowed) == {"jobs.state", "job_transitions.from_state", "job_transitions.to_state"}
        for column, values in allowed.items():
            assert values == {s.value for s in JobState}, column
        with pytest.raises(asyncpg.CheckViolationError):
            await conn.execute(
                """INSERT INTO job_transitions (job_id, attempt, from_state, to_state, cause, event_id)
                   VALUES ('j-x', 1, NULL, 'PAUSED', 'test', 'e-1')"""
            )
    finally:
        await conn.close()
