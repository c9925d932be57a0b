"""A 2-node x 1-rank DeepSpeed job across two hosts (network namespaces, gloo over their veths, the
rendezvous on the first host's address): it succeeds; a NaN on the second host's rank is judged, named
with that host's node, rolled back, and the job succeeds; the second host cut off the network is a lost
node, and the job is requeued onto the first host and succeeds, every step stored once."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

from tests.helpers import eventually
from tests.integration.scheduler.conftest import launched, next_event, wait_state
from tests.integration.worker.conftest import tiny_spec
from vigil.events import CheckpointSaved, IncidentRaised, RankStarted, RollbackCompleted
from vigil_bench.netns import Host, Network
from vigil_common import subjects

from .conftest import Plane, Workers, heartbeat_of, unique, wait_alive

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.multihost]


def spec(name: str, **train: Any) -> dict[str, Any]:
    """The worker tests' tiny two-rank job, on 2 nodes x 1 rank."""
    s = tiny_spec(**train)
    s["name"] = unique(name)
    assert s["resources"] == {"nodes": 2, "gpus_per_node": 1}
    return s


def in_host(pid: int, host: Host) -> bool:
    """Whether process `pid` runs in `host`'s network namespace."""
    return os.stat(f"/proc/{pid}/ns/net").st_ino == os.stat(f"/run/netns/{host.netns}").st_ino


def gloo_interface(pid: int) -> str | None:
    """The GLOO_SOCKET_IFNAME process `pid` was started with."""
    for item in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0"):
        if item.startswith(b"GLOO_SOCKET_IFNAME="):
            return item.split(b"=", 1)[1].decode()
    return None


async def rank_hosts(
    plane: Plane, job_id: str, network: Network, attempt: int = 1
) -> dict[int, tuple[str, str | None]]:
    """Each rank's host, from its process's network namespace, and the interface its gloo listens on
    (read while it runs)."""
    found: dict[int, tuple[str, str | None]] = {}

    def started(e: object) -> bool:
        if isinstance(e, RankStarted) and e.attempt == attempt:
            host = next((h.name for h in network.hosts if in_host(e.pid, h)), "none")
            found[e.rank] = (host, gloo_interface(e.pid))
        return len(found) == 2

    await next_event(plane.bus, subjects.job_status(job_id), started, timeout_s=120)
    return found


async def stored_steps(plane: Plane, job_id: str) -> list[tuple[int, int, int, str]]:
    rows = await plane.pool.fetch(
        "SELECT attempt, step, rank, node FROM telemetry_steps WHERE job_id = $1 ORDER BY attempt, step, rank",
        job_id,
    )
    return [(r["attempt"], r["step"], r["rank"], r["node"]) for r in rows]


async def test_a_two_node_job_runs_a_rank_on_each_host_and_succeeds(
    plane: Plane, workers: Workers, network: Network
) -> None:
    a, b = network.hosts
    wa, wb = workers.start(a), workers.start(b)
    assert (wa.node, wb.node) == ("hosta", "hostb")  # Vigil's default node name: the host's own name
    await wait_alive(plane, workers, wa.node, wb.node)
    assert (await heartbeat_of(plane.bus, wb.node)).address == b.address

    job_id = await plane.submit(spec("mh-ok", steps=8))
    launch = await launched(plane.bus, job_id, timeout_s=30)
    assert [(p.rank, p.node) for p in launch.placement] == [(0, wa.node), (1, wb.node)]
    assert launch.master_addr == a.address  # the rendezvous: rank 0's host, over the veth
    # gloo on the interface of the advertised address (left to itself: 127.0.1.1, the host name's)
    assert await rank_hosts(plane, job_id, network) == {0: ("a", "eth0"), 1: ("b", "eth0")}
    await wait_state(plane.bus, job_id, "SUCCEEDED", timeout_s=180)

    expected = [(1, s, r, (wa.node, wb.node)[r]) for s in range(8) for r in (0, 1)]

    async def all_stored() -> bool:
        return await stored_steps(plane, job_id) == expected

    await eventually(all_stored, timeout=30, what="every step of both ranks in telemetry")


async def test_a_nan_on_the_second_host_is_rolled_back_and_the_job_succeeds(
    plane: Plane, workers: Workers, network: Network
) -> None:
    a, b = network.hosts
    wa, wb = workers.start(a), workers.start(b)
    await wait_alive(plane, workers, wa.node, wb.node)
    s = spec("mh-nan", steps=10, faults=[{"kind": "nan", "step": 5, "rank": 1}], checkpoint={"every": 2})
    s["guardian"] = {"nan": "rollback", "replay": False}  # the rollback, not a replay of the step in place
    job_id = await plane.submit(s)
    assert await rank_hosts(plane, job_id, network) == {0: ("a", "eth0"), 1: ("b", "eth0")}

    incident = await next_event(
        plane.bus,
        subjects.incident(job_id),
        lambda e: isinstance(e, IncidentRaised) and e.kind == "nan",
        timeout_s=180,
    )
    assert isinstance(incident, IncidentRaised)
    assert (incident.kind, incident.step, incident.rank, incident.node) == ("nan", 5, 1, wb.node)
    assert incident.action == "rollback"
    done = await next_event(
        plane.bus, subjects.job_status(job_id), lambda e: isinstance(e, RollbackCompleted), timeout_s=120
    )
    assert isinstance(done, RollbackCompleted) and done.to_step == 4
    await wait_state(plane.bus, job_id, "SUCCEEDED", timeout_s=180)

    async def last_step_stored() -> bool:
        return any(step == 9 and rank == 1 for _, step, rank, _ in await stored_steps(plane, job_id))

    await eventually(last_step_stored, timeout=30, what="the last step in telemetry")
    stored = await plane.pool.fetch(
        "SELECT node, rank, step FROM telemetry_incidents WHERE job_id = $1 AND kind = 'nan'", job_id
    )
    assert [(r["node"], r["rank"], r["step"]) for r in stored] == [(wb.node, 1, 5)]


async def test_a_host_cut_off_is_a_lost_node_and_the_job_finishes_on_the_other(
    plane: Plane, workers: Workers, network: Network
) -> None:
    a, b = network.hosts
    # hosta has two slots, one of them taken by another job before hostb joins, so the 2-rank job spans
    # both hosts (placement packs a job onto one node when it can) and, once hostb is gone and the other
    # job is cancelled, fits on hosta alone
    wa = workers.start(a, slots=2, node=unique("hosta"))
    await wait_alive(plane, workers, wa.node)
    blocker = spec("mh-blocker", steps=1000, faults=[{"kind": "slow_rank", "step": 0, "delay_s": 5}])
    blocker["resources"] = {"nodes": 1, "gpus_per_node": 1}
    blocker_id = await plane.submit(blocker)
    assert [p.node for p in (await launched(plane.bus, blocker_id, timeout_s=30)).placement] == [wa.node]
    wb = workers.start(b, node=unique("hostb"))
    await wait_alive(plane, workers, wa.node, wb.node)

    job_id = await plane.submit(spec("mh-lost", steps=12, checkpoint={"every": 4}))
    first = await launched(plane.bus, job_id, timeout_s=30)
    assert [(p.rank, p.node) for p in first.placement] == [(0, wa.node), (1, wb.node)]
    await next_event(
        plane.bus,
        subjects.job_status(job_id),
        lambda e: isinstance(e, CheckpointSaved) and e.step >= 4,
        timeout_s=180,
    )

    b.cut()
    try:
        await wait_state(plane.bus, job_id, "PENDING", timeout_s=30, cause=f"node {wb.node} lost")
        assert wb.node not in await plane.alive()
        lost = await next_event(
            plane.bus,
            subjects.incident(job_id),
            lambda e: isinstance(e, IncidentRaised) and e.kind == "node_lost",
        )
        assert isinstance(lost, IncidentRaised) and lost.node == wb.node
        assert (await plane.http.post(f"/api/v1/jobs/{blocker_id}/cancel")).status_code < 300
        second = await launched(plane.bus, job_id, attempt=2, timeout_s=60)
        assert [(p.rank, p.node) for p in second.placement] == [(0, wa.node), (1, wa.node)]
        assert second.master_addr == a.address and second.resume_from is not None
        resumed = int(Path(second.resume_from).name.removeprefix("step_"))
        assert resumed >= 4
        await wait_state(plane.bus, job_id, "SUCCEEDED", timeout_s=180)
    finally:
        workers.kill(b)  # the cut-off host's worker and rank, before its link comes back
        b.reconnect()

    async def final_steps_stored() -> list[tuple[int, int, int, str]] | None:
        rows = await stored_steps(plane, job_id)
        return rows if sum(1 for attempt, *_ in rows if attempt == 2) >= 2 * (12 - resumed) else None

    rows = await eventually(final_steps_stored, timeout=30, what="attempt 2's steps in telemetry")
    keys = [(attempt, step, rank) for attempt, step, rank, _ in rows]
    assert len(keys) == len(set(keys)), "a step of a rank stored twice"
    # attempt 2 ran every step from its checkpoint on, both ranks on hosta; attempt 1 every step before it
    assert [(s, r, n) for at, s, r, n in rows if at == 2] == [
        (s, r, wa.node) for s in range(resumed, 12) for r in (0, 1)
    ]
    first_rows = {(s, r): n for at, s, r, n in rows if at == 1}
    assert all(first_rows.get((s, r)) == (wa.node, wb.node)[r] for s in range(resumed) for r in (0, 1))
