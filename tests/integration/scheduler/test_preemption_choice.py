"""Which running job the placement pass preempts, against the real scheduler and Postgres with a simulated
node: never one the spec marks `scheduling.preemptible: false`, never one of equal priority; one notice
however many passes run before the victim exits; the preemptor takes the victim's device."""

from __future__ import annotations

import json
from typing import Any

import pytest

from vigil.events import LaunchJob, PreemptJob
from vigil_common import subjects
from vigil_common.bus import Bus

from .conftest import Running, count_on, exit_rank, launched, next_event, start_ranks, wait_state

pytestmark = pytest.mark.integration


def one_slot(name: str, priority: int, **scheduling: Any) -> dict[str, Any]:
    body: dict[str, Any] = {"name": name, "priority": priority, "resources": {"nodes": 1, "gpus_per_node": 1}}
    return body | ({"scheduling": scheduling} if scheduling else {})


async def test_only_a_preemptible_job_of_lower_priority_is_preempted_once(
    scheduler: Running, nodes, bus: Bus
) -> None:
    node = nodes(slots=3)
    running: dict[str, LaunchJob] = {}
    for name, priority, scheduling in (
        ("keep", 10, {"preemptible": False}),  # lower priority, but its spec says never
        ("peer", 50, {}),  # preemptible by the operator's rule (50 < 100), but of equal priority
        ("low", 10, {}),
    ):
        jid = (await scheduler.http.post("/api/v1/jobs", json=one_slot(name, priority, **scheduling))).json()[
            "id"
        ]
        running[name] = await launched(bus, jid)
        await start_ranks(bus, running[name])
        await wait_state(bus, jid, "RUNNING")
    node.busy = {0, 1, 2}
    high = (await scheduler.http.post("/api/v1/jobs", json=one_slot("high", 50))).json()["id"]

    low = running["low"]
    notice = await next_event(bus, subjects.cmd(str(low.job_id)), lambda e: isinstance(e, PreemptJob))
    assert isinstance(notice, PreemptJob) and notice.by_job == high
    assert notice.reason == f"preempted by {high} (priority 50 > 10): needs 1 CPU slot"
    for name in ("keep", "peer"):
        assert await count_on(bus, subjects.COMMANDS.name, subjects.cmd(str(running[name].job_id))) == 0
    # another job of priority 50 asks for a pass before the victim exits: its stop in flight makes the room
    # the first blocked job (high) needs, so nobody more is preempted
    await scheduler.http.post("/api/v1/jobs", json=one_slot("high2", 50))

    await exit_rank(bus, low, 0, 4, failure="preempted")
    requeued = await wait_state(bus, str(low.job_id), "PENDING", attempt=2)
    assert requeued.cause.startswith(f"preempted by {high} (priority 50 > 10): needs 1 CPU slot; rank 0 on")
    node.busy = {0, 1, 2} - {p.device for p in low.placement}  # its worker reports the device free
    taken = await launched(bus, high)
    assert [p.device for p in taken.placement] == [p.device for p in low.placement]
    for name in ("keep", "peer"):
        assert await count_on(bus, subjects.COMMANDS.name, subjects.cmd(str(running[name].job_id))) == 0
    assert await count_on(bus, subjects.COMMANDS.name, subjects.cmd(str(low.job_id))) == 1
    stops = await scheduler.pool.fetch("SELECT job_id, attempt, kind, by_job, devices FROM job_stops")
    assert [(r["job_id"], r["attempt"], r["kind"], r["by_job"]) for r in stops] == [
        (low.job_id, 1, "preempt", high)
    ]
    assert json.loads(stops[0]["devices"]) == [[p.node, p.device] for p in low.placement]
