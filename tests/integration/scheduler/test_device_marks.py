"""Device marks against the real schema (migration 0015): one job's replays mark at most
VIGIL_DEVICE_MARKS_PER_JOB devices, their marks expire, a worker's failed diagnostic confirms a mark for
good, and an operator clears one with `vigil gpus --clear`, which the audit record keeps."""

from __future__ import annotations

import json
import uuid

import asyncpg
import pytest

from tests.helpers import eventually
from vigil_scheduler import inventory
from vigil_scheduler.audit import token_actor

from .conftest import TOKEN
from .test_cli import vigil

pytestmark = pytest.mark.integration


@pytest.fixture
def node() -> str:
    return f"n-{uuid.uuid4().hex[:8]}"


async def mark(pool: asyncpg.Pool, node: str, index: int, job: str | None, **kw: object) -> bool:
    async with pool.acquire() as conn, conn.transaction():
        return await inventory.mark_unhealthy(conn, node, index, f"why {index}", job_id=job, **kw)  # type: ignore[arg-type]


async def with_devices(pool: asyncpg.Pool, node: str, count: int) -> None:
    await pool.execute(
        """INSERT INTO nodes (name, address, started_at, interval_s, last_heartbeat)
           VALUES ($1, '127.0.0.1', now(), 1, now())""",
        node,
    )
    await pool.executemany(
        "INSERT INTO devices (node, index, kind, name, uuid) VALUES ($1, $2, 'cpu', 'cpu', $3)",
        [(node, i, f"{node}-{i}") for i in range(count)],
    )


async def healthy(pool: asyncpg.Pool, node: str) -> list[int]:
    async with pool.acquire() as conn:
        found = await inventory.load_inventory(conn)
    return [d.index for n in found.nodes if n.name == node for d in n.devices if d.healthy]


def replay(ttl_s: float = 3600.0, per_job: int = 2) -> dict[str, object]:
    return {"source": "replay", "ttl_s": ttl_s, "per_job": per_job}


async def test_one_jobs_replays_mark_at_most_per_job_devices(pool: asyncpg.Pool, node: str) -> None:
    await with_devices(pool, node, 5)
    assert [await mark(pool, node, i, "j-greedy", **replay()) for i in range(4)] == [True, True, False, False]
    assert await healthy(pool, node) == [2, 3, 4]
    assert await mark(pool, node, 2, "j-other", **replay())  # the cap is per job
    assert not await mark(pool, node, 1, "j-greedy", **replay())  # a device it holds already: no new mark
    # a mark that lapsed no longer counts: the job may mark another device
    await pool.execute(
        "UPDATE device_marks SET expires_at = now() - interval '1 s' WHERE node = $1 AND index = 0", node
    )
    assert await mark(pool, node, 3, "j-greedy", **replay())
    assert await healthy(pool, node) == [0, 4]


async def test_a_replays_mark_expires_and_a_diagnostic_confirms_it_for_good(
    pool: asyncpg.Pool, node: str
) -> None:
    await with_devices(pool, node, 3)
    assert await mark(pool, node, 0, "j-a", **replay(ttl_s=600))
    expires = await pool.fetchval("SELECT expires_at - marked_at FROM device_marks WHERE node = $1", node)
    assert expires.total_seconds() == pytest.approx(600, abs=1)
    assert await healthy(pool, node) == [1, 2]
    await pool.execute("UPDATE device_marks SET expires_at = now() - interval '1 s' WHERE node = $1", node)
    assert await healthy(pool, node) == [0, 1, 2]  # lapsed: offered again without anyone clearing it

    # the worker's failed check confirms a mark: no expiry, and a job's replay never weakens it
    assert await mark(pool, node, 1, "j-a", **replay())
    assert await mark(pool, node, 1, "j-a", source="diagnostic")
    assert not await mark(pool, node, 1, "j-b", **replay())
    row = await pool.fetchrow(
        "SELECT source, confirmed, expires_at, job_id FROM device_marks WHERE node = $1 AND index = 1", node
    )
    assert dict(row) == {"source": "diagnostic", "confirmed": True, "expires_at": None, "job_id": "j-a"}
    # confirmed marks are not capped: the cap bounds what a job's own word can do
    assert await mark(pool, node, 2, "j-a", source="diagnostic")
    assert await healthy(pool, node) == [0]


async def test_vigil_gpus_clear_removes_the_mark_and_audits_it(scheduler, nodes) -> None:
    fake = nodes(slots=2)
    await fake.beat()
    await eventually(lambda: healthy(scheduler.pool, fake.name), what="the node's devices")
    assert await mark(scheduler.pool, fake.name, 1, "j-sdc", source="diagnostic")
    gpus = json.loads((await vigil(scheduler, "gpus", "--json")).output)["items"]
    assert [(g["index"], g["healthy"], g["mark_source"]) for g in gpus] == [
        (0, True, None),
        (1, False, "diagnostic"),
    ]

    r = await vigil(scheduler, "gpus", "--clear", f"{fake.name}:1")
    assert r.exit_code == 0, r.output
    assert f"{fake.name}:1 mark cleared (was diagnostic: why 1)" in r.output
    assert await healthy(scheduler.pool, fake.name) == [0, 1]
    (record,) = (await scheduler.http.get("/api/v1/audit")).json()["items"][:1]
    assert (record["action"], record["actor"], record["job_id"]) == (
        "clear_device_mark",
        token_actor(TOKEN),
        None,
    )
    assert record["detail"]["node"] == fake.name and record["detail"]["index"] == 1
    assert record["detail"]["source"] == "diagnostic" and record["detail"]["job_id"] == "j-sdc"

    again = await vigil(scheduler, "gpus", "--clear", f"{fake.name}:1")
    assert again.exit_code != 0 and f"device {fake.name}:1 has no unhealthy mark" in again.output
    bad = await vigil(scheduler, "gpus", "--clear", "n1")
    assert bad.exit_code == 2 and "expected NODE:DEVICE" in bad.output
    assert await mark(scheduler.pool, fake.name, 0, None, source="diagnostic")
    refused = await vigil(scheduler, "gpus", "--clear", f"{fake.name}:0", token="not-the-admin-token-0123")
    assert refused.exit_code != 0 and await healthy(scheduler.pool, fake.name) == [1]
