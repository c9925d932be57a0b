"""The cluster's picture in Postgres: nodes and devices from worker heartbeats, health marks from
the guardian, node-lost detection, and the snapshot placement works on."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Literal

import asyncpg

from vigil.events import NodeHeartbeat
from vigil.jobstates import JobState
from vigil_scheduler.placement import Inventory, NodeState, Slot

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class HeartbeatResult:
    new_node: bool  # first heartbeat, or the first after the node was lost
    restarted: bool  # the worker process restarted (started_at changed)
    changed: bool  # anything placement cares about changed: free, health, devices, liveness


async def record_heartbeats(
    conn: asyncpg.Connection, heartbeats: Sequence[NodeHeartbeat]
) -> dict[str, HeartbeatResult]:
    """Upsert the nodes and their devices (one heartbeat per node, the newest); the heartbeat time is
    the scheduler's receipt time.

    A batch costs three statements whatever its size (the nodes before, their upsert, their devices);
    devices are written only for the nodes whose devices changed, which a steady heartbeat's are not.
    """
    by_node = {hb.node: hb for hb in heartbeats}
    names = sorted(by_node)  # rows locked in one order by every batch
    before = {
        r["name"]: r
        for r in await conn.fetch(
            "SELECT name, alive, started_at FROM nodes WHERE name = ANY($1::text[]) ORDER BY name FOR UPDATE",
            names,
        )
    }
    await conn.execute(
        """INSERT INTO nodes (name, address, started_at, interval_s, last_heartbeat, alive)
           SELECT u.name, u.address, u.started_at, u.interval_s, now(), true
           FROM unnest($1::text[], $2::text[], $3::timestamptz[], $4::float8[])
               AS u(name, address, started_at, interval_s)
           ON CONFLICT (name) DO UPDATE SET address = EXCLUDED.address, started_at = EXCLUDED.started_at,
               interval_s = EXCLUDED.interval_s, last_heartbeat = now(), alive = true, lost_at = NULL""",
        names,
        [by_node[n].address for n in names],
        [by_node[n].started_at for n in names],
        [by_node[n].interval_s for n in names],
    )
    old: dict[str, dict[int, tuple[bool, bool, bool]]] = {n: {} for n in names}
    for r in await conn.fetch(
        """SELECT node, index, reported_free, reported_healthy, present FROM devices
           WHERE node = ANY($1::text[])""",
        names,
    ):
        old[r["node"]][r["index"]] = (r["reported_free"], r["reported_healthy"], r["present"])
    results: dict[str, HeartbeatResult] = {}
    for name in names:
        hb, prior = by_node[name], before.get(name)
        restarted = prior is not None and prior["started_at"] != hb.started_at
        free = set(hb.free)
        devices = old[name]
        changed = prior is None or not prior["alive"] or restarted
        changed = changed or {i for i, v in devices.items() if v[2]} != {d.index for d in hb.devices}
        changed = changed or any(
            devices.get(d.index) != (d.index in free, d.healthy, True) for d in hb.devices
        )
        results[name] = HeartbeatResult(
            new_node=prior is None or not prior["alive"], restarted=restarted, changed=changed
        )
    changed_hbs = [by_node[n] for n in names if results[n].changed]
    if changed_hbs:
        await _record_devices(conn, changed_hbs)
    restarted_hbs = [by_node[n] for n in names if results[n].restarted]
    if restarted_hbs:  # a new worker process: the guardian's marks were about the old one's run (a failed
        # known-answer check is about the device itself: it stays until an operator clears it)
        await conn.executemany(
            "DELETE FROM device_marks WHERE node = $1 AND marked_at < $2 AND source <> 'diagnostic'",
            [(hb.node, hb.started_at) for hb in restarted_hbs],
        )
    return results


async def _record_devices(conn: asyncpg.Connection, heartbeats: Sequence[NodeHeartbeat]) -> None:
    """The devices each heartbeat reports, and those it no longer reports marked absent."""
    await conn.executemany(
        """INSERT INTO devices (node, index, kind, name, uuid, memory_bytes, nvlink_peers,
                                present, reported_healthy, reported_free)
           VALUES ($1, $2, $3, $4, $5, $6, $7, true, $8, $9)
           ON CONFLICT (node, index) DO UPDATE SET kind = $3, name = $4, uuid = $5, memory_bytes = $6,
               nvlink_peers = $7, present = true, reported_healthy = $8, reported_free = $9""",
        [
            (hb.node, d.index, d.kind, d.name, d.uuid, d.memory_bytes, d.nvlink_peers, d.healthy,
             d.index in hb.free)
            for hb in heartbeats
            for d in hb.devices
        ],
    )  # fmt: skip
    await conn.executemany(
        "UPDATE devices SET present = false WHERE node = $1 AND NOT (index = ANY($2::int[]))",
        [(hb.node, [d.index for d in hb.devices]) for hb in heartbeats],
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


async def mark_lost(conn: asyncpg.Connection, nodes: list[str]) -> list[str]:
    """Mark lost those of `nodes` still alive (on evidence stronger than silence: `Scheduler.check_peers`)."""
    rows = await conn.fetch(
        """UPDATE nodes SET alive = false, lost_at = now() WHERE alive AND name = ANY($1::text[])
           RETURNING name""",
        nodes,
    )
    return sorted(r["name"] for r in rows)


async def nodes_of_job(conn: asyncpg.Connection, job_id: str) -> list[str]:
    """The live nodes that hold a device of `job_id`."""
    rows = await conn.fetch(
        """SELECT DISTINCT d.node FROM devices d JOIN nodes n ON n.name = d.node
           WHERE d.job_id = $1 AND n.alive ORDER BY d.node""",
        job_id,
    )
    return [r["node"] for r in rows]


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


# A mark holds while it has not expired (marks from a job's replays expire; confirmed ones never do).
ACTIVE_MARK = "(m.node IS NOT NULL AND (m.expires_at IS NULL OR m.expires_at > now()))"
MarkSource = Literal["gpu_health", "replay", "diagnostic"]


async def mark_unhealthy(
    conn: asyncpg.Connection,
    node: str,
    index: int,
    reason: str,
    *,
    source: MarkSource = "gpu_health",
    job_id: str | None = None,
    ttl_s: float | None = None,
    per_job: int | None = None,
) -> bool:
    """Mark a device unhealthy; True when it was not marked (or its mark had expired) before.

    `gpu_health` (the worker's NVML samples) and `diagnostic` (the worker's known-answer check failed)
    are confirmed: they hold until an operator clears them. `replay` (a job's replays, strikes of the
    built-in trainer) expires after `ttl_s`, and one job holds at most `per_job` such marks at once: past
    that, its replays mark nothing (False). A confirmed mark is never weakened into an expiring one.
    """
    confirmed = source != "replay"
    if not confirmed and per_job is not None:
        held = await conn.fetchval(
            f"""SELECT count(*) FROM device_marks m WHERE m.job_id = $1 AND NOT m.confirmed
                AND {ACTIVE_MARK} AND NOT (m.node = $2 AND m.index = $3)""",
            job_id,
            node,
            index,
        )
        if held >= per_job:
            log.warning(
                "device %s:%d not marked: job %s holds %d marks already (VIGIL_DEVICE_MARKS_PER_JOB)",
                node,
                index,
                job_id,
                held,
            )
            return False
    row = await conn.fetchrow(
        """INSERT INTO device_marks AS m (node, index, reason, job_id, expires_at, confirmed, source)
           VALUES ($1, $2, $3, $4, now() + make_interval(secs => $5::float8), $6, $7)
           ON CONFLICT (node, index) DO UPDATE SET
               reason = EXCLUDED.reason, job_id = EXCLUDED.job_id, expires_at = EXCLUDED.expires_at,
               confirmed = EXCLUDED.confirmed, source = EXCLUDED.source, marked_at = now()
           WHERE (m.expires_at IS NOT NULL AND m.expires_at <= now())
              OR (EXCLUDED.confirmed AND NOT m.confirmed)
           RETURNING 1""",
        node,
        index,
        reason,
        job_id,
        None if confirmed else ttl_s,
        confirmed,
        source,
    )
    return row is not None


async def clear_mark(conn: asyncpg.Connection, node: str, index: int) -> dict[str, Any] | None:
    """An operator's clearing of a device's mark: the mark removed (returned), or None if there was none."""
    row = await conn.fetchrow(
        """DELETE FROM device_marks WHERE node = $1 AND index = $2
           RETURNING reason, source, job_id, confirmed, marked_at, expires_at""",
        node,
        index,
    )
    return None if row is None else dict(row)


async def load_inventory(conn: asyncpg.Connection) -> Inventory:
    """The snapshot placement works on: live nodes with their present devices."""
    rows = await conn.fetch(
        f"""SELECT n.name, n.address, d.index, d.kind,
                  d.reported_healthy AND NOT {ACTIVE_MARK} AS healthy,
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
