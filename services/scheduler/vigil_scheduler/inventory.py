"""The cluster's picture in Postgres: nodes and devices from worker heartbeats, health marks from
the guardian, node-lost detection, and the snapshot placement works on."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime

import asyncpg

from vigil_common.events import NodeHeartbeat
from vigil_common.jobstates import JobState
from vigil_scheduler.placement import Inventory, NodeState, Slot


@dataclass(frozen=True)
class HeartbeatResult:
    new_node: bool  # first heartbeat, or the first after the node was lost
    restarted: bool  # the worker process restarted (started_at changed)
    changed: bool  # anything placement cares about changed: free, health, devices, liveness


async def record_heartbeat(conn: asyncpg.Connection, hb: NodeHeartbeat) -> HeartbeatResult:
    """Upsert the node and its devices; the heartbeat time is the scheduler's receipt time."""
    before = await conn.fetchrow("SELECT alive, started_at FROM nodes WHERE name = $1 FOR UPDATE", hb.node)
    await conn.execute(
        """INSERT INTO nodes (name, address, started_at, interval_s, last_heartbeat, alive)
           VALUES ($1, $2, $3, $4, now(), true)
           ON CONFLICT (name) DO UPDATE SET address = $2, started_at = $3, interval_s = $4,
               last_heartbeat = now(), alive = true, lost_at = NULL""",
        hb.node,
        hb.address,
        hb.started_at,
        hb.interval_s,
    )
    restarted = before is not None and before["started_at"] != hb.started_at
    free = set(hb.free)
    old = {
        r["index"]: (r["reported_free"], r["reported_healthy"], r["present"])
        for r in await conn.fetch(
            "SELECT index, reported_free, reported_healthy, present FROM devices WHERE node = $1", hb.node
        )
    }
    changed = before is None or not before["alive"] or restarted
    changed = changed or {i for i, v in old.items() if v[2]} != {d.index for d in hb.devices}
    for d in hb.devices:
        now = (d.index in free, d.healthy, True)
        changed = changed or old.get(d.index) != now
    if changed:
        await conn.executemany(
            """INSERT INTO devices (node, index, kind, name, uuid, memory_bytes, nvlink_peers,
                                    present, reported_healthy, reported_free)
               VALUES ($1, $2, $3, $4, $5, $6, $7, true, $8, $9)
               ON CONFLICT (node, index) DO UPDATE SET kind = $3, name = $4, uuid = $5, memory_bytes = $6,
                   nvlink_peers = $7, present = true, reported_healthy = $8, reported_free = $9""",
            [
                (
                    hb.node,
                    d.index,
                    d.kind,
                    d.name,
                    d.uuid,
                    d.memory_bytes,
                    d.nvlink_peers,
                    d.healthy,
                    d.index in free,
                )
                for d in hb.devices
            ],
        )
        reported = [d.index for d in hb.devices]
        await conn.execute(
            "UPDATE devices SET present = false WHERE node = $1 AND NOT (index = ANY($2::int[]))",
            hb.node,
            reported,
        )
        if restarted:  # a new worker process: the guardian's marks were about the old one's run
            await conn.execute(
                "DELETE FROM device_marks WHERE node = $1 AND marked_at < $2", hb.node, hb.started_at
            )
    return HeartbeatResult(
        new_node=before is None or not before["alive"], restarted=restarted, changed=changed
    )


async def lost_nodes(conn: asyncpg.Connection, lost_after: int, not_before: datetime) -> list[str]:
    """Mark lost every live node silent for `lost_after` of its heartbeat intervals (counting from
    `not_before` at the latest, so a restarted scheduler first gives heartbeats time to arrive)."""
    rows = await conn.fetch(
        """UPDATE nodes SET alive = false, lost_at = now()
           WHERE alive AND now() - GREATEST(last_heartbeat, $2) > make_interval(secs => interval_s * $1)
           RETURNING name""",
        lost_after,
        not_before,
    )
    return sorted(r["name"] for r in rows)


async def jobs_on_node(conn: asyncpg.Connection, node: str) -> list[str]:
    rows = await conn.fetch(
        "SELECT DISTINCT job_id FROM devices WHERE node = $1 AND job_id IS NOT NULL ORDER BY job_id", node
    )
    return [r["job_id"] for r in rows]


async def jobs_with_vanished_ranks(conn: asyncpg.Connection, node: str) -> list[str]:
    """Jobs running on `node` whose devices its (restarted) worker now reports free: the ranks are gone."""
    rows = await conn.fetch(
        """SELECT DISTINCT d.job_id FROM devices d JOIN jobs j ON j.id = d.job_id
           WHERE d.node = $1 AND d.reported_free AND j.state = ANY($2::text[])
           ORDER BY d.job_id""",
        node,
        [JobState.RUNNING, JobState.HALTED, JobState.ROLLING_BACK],
    )
    return [r["job_id"] for r in rows]


async def mark_unhealthy(conn: asyncpg.Connection, node: str, index: int, reason: str) -> bool:
    """Mark a device unhealthy (guardian `gpu_health`); True when it was not marked before."""
    status = await conn.execute(
        """INSERT INTO device_marks (node, index, reason) VALUES ($1, $2, $3)
           ON CONFLICT (node, index) DO NOTHING""",
        node,
        index,
        reason,
    )
    return status.endswith(" 1")


async def load_inventory(conn: asyncpg.Connection) -> Inventory:
    """The snapshot placement works on: live nodes with their present devices."""
    rows = await conn.fetch(
        """SELECT n.name, n.address, d.index, d.kind,
                  d.reported_healthy AND m.node IS NULL AS healthy,
                  d.reported_free, d.job_id, d.nvlink_peers
           FROM nodes n JOIN devices d ON d.node = n.name
           LEFT JOIN device_marks m ON m.node = d.node AND m.index = d.index
           WHERE n.alive AND d.present
           ORDER BY n.name, d.index"""
    )
    nodes: dict[str, tuple[str, list[Slot]]] = {}
    for r in rows:
        nodes.setdefault(r["name"], (r["address"], []))[1].append(
            Slot(
                index=r["index"],
                kind=r["kind"],
                healthy=r["healthy"],
                reported_free=r["reported_free"],
                job_id=r["job_id"],
                nvlink=frozenset(r["nvlink_peers"]),
            )
        )
    return Inventory(
        tuple(
            NodeState(name=name, address=addr, devices=tuple(slots)) for name, (addr, slots) in nodes.items()
        )
    )
