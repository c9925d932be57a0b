"""The queue's rows parsed once while they do not change: a row seen again gives the same `Job`, a changed
row a new one, and a job gone from the queue is forgotten."""

from __future__ import annotations

import json
from datetime import UTC, datetime
from typing import Any

from vigil_scheduler.queued_jobs import QueuedJobs

AT = datetime(2026, 11, 28, tzinfo=UTC)


def row(job_id: str, seq: int, **changed: Any) -> dict[str, Any]:
    """A `jobs` row as the pass reads it (JSON columns as text)."""
    return {
        "id": job_id, "seq": seq, "name": job_id, "state": "PENDING", "priority": 0,
        "spec": json.dumps({"name": job_id, "scheduling": {"time_limit": 60.0}}), "world_size": 1,
        "max_nodes": 1, "attempt": 1, "queued": True, "placement": None, "previous_placement": None,
        "master_addr": None, "master_port": None, "resume_from": None, "skip_data": None, "reason": None,
        "completed_commands": [], "trace_context": "{}", "created_at": AT, "updated_at": AT,
        "finished_at": None, "owner": "alice", "team": "vision", "queue_reason": None, "progress_at": None,
        "recovery": None, "recovery_incidents": None,
        **changed,
    }  # fmt: skip


def test_a_row_seen_again_is_not_parsed_again() -> None:
    queued = QueuedJobs()
    first = queued.jobs([row("j-a", 1), row("j-b", 2)])
    again = queued.jobs([row("j-a", 1), row("j-b", 2)])
    assert list(again) == ["j-a", "j-b"]
    assert again["j-a"] is first["j-a"] and again["j-b"] is first["j-b"]
    assert again["j-a"].spec == {"name": "j-a", "scheduling": {"time_limit": 60.0}}


def test_a_changed_row_is_parsed_again() -> None:
    queued = QueuedJobs()
    first = queued.jobs([row("j-a", 1)])["j-a"]
    edited = json.dumps({"name": "j-a", "scheduling": {"time_limit": 120.0}})
    requeued = queued.jobs([row("j-a", 1, attempt=2, spec=edited)])["j-a"]
    assert requeued is not first and requeued.attempt == 2
    assert requeued.spec["scheduling"]["time_limit"] == 120.0
    noted = queued.jobs([row("j-a", 1, attempt=2, spec=edited, queue_reason="quota")])["j-a"]
    assert noted is not requeued and noted.queue_reason == "quota"


def test_a_job_gone_from_the_queue_is_forgotten() -> None:
    queued = QueuedJobs()
    first = queued.jobs([row("j-a", 1), row("j-b", 2)])
    assert list(queued.jobs([row("j-b", 2)])) == ["j-b"]
    back = queued.jobs([row("j-a", 1), row("j-b", 2)])
    assert back["j-a"] is not first["j-a"] and back["j-b"] is first["j-b"]
