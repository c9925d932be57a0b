"""The ranks' own report of an out-of-memory they could not cure becomes the guardian's `oom` incident."""

from __future__ import annotations

from datetime import UTC, datetime

from vigil import events as ev
from vigil_guardian.core import Guardian


def test_an_out_of_memory_report_is_recorded_as_an_oom_incident_once():
    g = Guardian()
    now = datetime.now(UTC)
    report = ev.OutOfMemoryHalted(
        job_id="j", attempt=1, step=7, rank=1, node="a", micro_batch=2, grad_accum=2, checkpoint_step=7,
        message="rank 1 ran out of memory at step 7",
    )  # fmt: skip
    (d,) = g.on_event(report, now)
    inc = d.incident
    assert (inc.kind, inc.action, inc.step, inc.rank, inc.node) == ("oom", "halt", 7, 1, None)
    assert inc.event_id == report.event_id and inc.evidence == {
        "micro_batch": 2,
        "grad_accum": 2,
        "checkpoint_step": 7,
    }
    assert d.commands == (), "the ranks halted themselves: nothing to command"
    g.mark_published(inc.event_id)
    assert g.on_event(report, now) == [], "a replayed report is not published twice"
