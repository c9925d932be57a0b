"""The console's pure shaping: downsampled curves, the step trace's bars, grid colours, the NVLink graph,
and the step trace read back from real span JSON lines (written by telemetry's own tracing code)."""

from __future__ import annotations

import math
import re
from datetime import UTC, datetime, timedelta
from pathlib import Path

from tests.helpers import step_completed
from vigil.events import RankStacks, StackFrame, StacksDumped, ThreadStack
from vigil.jobstates import JobState
from vigil_common.readmodel import SERIES_METRICS
from vigil_common.tracing import setup_tracing
from vigil_guardian.stacks import explain
from vigil_scheduler.console import spans, views
from vigil_telemetry.traces import StepTraces

CONSOLE = Path(views.__file__).parent


def bucket_row(rank: int, bucket: int, width: int, loss: float, bad: int = 0, lo=None, hi=None) -> dict:
    row = {
        "rank": rank,
        "bucket": bucket,
        "first_step": bucket * width,
        "last_step": bucket * width + width - 1,
    }
    for m in SERIES_METRICS:
        row.update({m: loss, f"{m}_lo": loss if lo is None else lo, f"{m}_hi": loss if hi is None else hi})
        row[f"{m}_bad"] = bad if m == "loss" else 0
    return row


def test_bucket_width_caps_the_points_and_shares_them_among_many_ranks():
    assert views.bucket_width(200) == 1
    assert views.bucket_width(1000, points=500) == 2  # from the raw rows
    # widths the stored buckets serve: at most the points asked for, at least half as many
    assert views.bucket_width(10_000) == 16  # 625 of the 1,000 points asked for: stored width 16
    assert views.bucket_width(10_000, points=50_000) == 8  # never more than MAX_POINTS (2 x width 4)
    assert views.bucket_width(10_000, ranks=64) == 32  # 313 of the 500 points per rank (2 x width 16)
    assert views.bucket_width(0) == 1


def test_every_job_state_has_a_colour_and_nothing_else_spells_one():
    assert set(views.STATE_COLOURS) == set(JobState)
    css = views.states_css()
    assert all(f".state.{s.value} {{ background: {views.STATE_COLOURS[s]}; }}" in css for s in JobState)
    # the templates take JobState and FINISHED; the stylesheet, script and Python spell no state
    spelled = re.compile("|".join(rf"\b{s.value}\b" for s in JobState))
    for path in [*CONSOLE.glob("templates/*.html"), *CONSOLE.glob("static/*.*"), *CONSOLE.glob("*.py")]:
        if path.name == "views.py":
            continue  # STATE_COLOURS names the members (JobState.RUNNING, ...)
        assert not spelled.search(path.read_text()), path


def test_the_job_header_and_tables_are_shaped_for_the_page():
    job = {
        "id": "j-1",
        "state": "RUNNING",
        "attempt": 2,
        "priority": 0,
        "last_step": 11,
        "loss": math.nan,
        "reason": None,
        "spec": {"train": {"steps": 40}},
        "attempts": [
            {"attempt": 1, "launched_at": None, "placement": [{"rank": 0, "node": "n1"}],
             "resume_from": None, "ended": "rank 1 exited"},
            {"attempt": 2, "launched_at": None, "placement": [{"rank": 0, "node": "n2"}, {"rank": 1, "node": "n2"}],
             "resume_from": "/c/step_5", "ended": None},
        ],
    }  # fmt: skip
    header = views.job_header(job)
    assert header["finished"] is False and header["loss"] == "nan" and header["steps"] == 40
    assert views.job_header(job | {"state": "SUCCEEDED", "loss": 2.31234})["loss"] == "2.3123"
    assert views.job_header(job | {"state": JobState.CANCELLED, "loss": None})["finished"] is True
    rows = views.attempt_rows(job)
    assert [r["ended"] for r in rows] == ["rank 1 exited", "running"]
    assert rows[1]["placement"] == "rank 0@n2, rank 1@n2" and rows[0]["resume_from"] == "start"
    assert views.attempt_rows(job | {"state": "FAILED"})[1]["ended"] == ""
    (c,) = views.checkpoint_rows(
        [{"step": 5, "valid": False, "bytes": 3 << 20, "attempt": 1, "path": "/c", "created_at": None}]
    )
    assert c["size"] == "3.0 MiB" and c["valid"] is False


def test_series_aligns_ranks_on_one_x_with_mean_band_and_non_finite_buckets():
    rows = [
        bucket_row(0, 0, 10, 4.0, lo=3.5, hi=4.5),
        bucket_row(1, 0, 10, 2.0, lo=1.0, hi=2.5),
        bucket_row(0, 1, 10, 3.0, lo=2.0, hi=50.0),  # a spike inside the bucket
        bucket_row(1, 2, 10, 1.0, bad=1),  # rank 0 has not reported bucket 2 yet
    ]
    out = views.series(rows, 10)
    assert out["x"] == [0, 10, 20] and out["ranks"] == [0, 1] and out["last_step"] == 29
    loss = out["metrics"]["loss"]
    assert loss["ranks"] == [[4.0, 3.0, None], [2.0, None, 1.0]]
    assert loss["mean"] == [3.0, 3.0, 1.0]
    assert loss["lo"] == [1.0, 2.0, 1.0] and loss["hi"] == [4.5, 50.0, 1.0]
    assert loss["bad"] == [20]
    assert out["metrics"]["tokens_per_s"]["mean"] == [6.0, 3.0, 1.0]  # throughput sums over ranks


def test_series_without_downsampling_puts_each_step_at_its_own_x():
    out = views.series([bucket_row(0, 7, 1, 2.0) | {"first_step": 7, "last_step": 7}], 1)
    assert out["x"] == [7]
    assert views.series([], 1) == {
        "bucket": 1,
        "x": [],
        "ranks": [],
        "last_step": None,
        "metrics": {
            m: {"ranks": [], "mean": [], "abandoned": [], "lo": [], "hi": [], "bad": []}
            for m in SERIES_METRICS
        },
    }


def test_series_draws_the_runs_a_rollback_abandoned_apart_from_the_re_run():
    # Bucket 1 (steps 10..19) of each rank holds 10 steps of the re-run and 4 abandoned ones (steps
    # 15..18 ran first with a loss of 9.0 before the rollback to 15): the stored bucket mixes both.
    rows = [
        bucket_row(0, 0, 10, 4.0) | {f"{m}_n": 10 for m in SERIES_METRICS},
        bucket_row(0, 1, 10, (10 * 2.0 + 4 * 9.0) / 14) | {f"{m}_n": 14 for m in SERIES_METRICS},
        bucket_row(1, 1, 10, (10 * 3.0 + 4 * 9.0) / 14) | {f"{m}_n": 14 for m in SERIES_METRICS},
    ]
    abandoned = [
        {
            "rank": r,
            "bucket": 1,
            **{f"{m}_sum": 36.0 for m in SERIES_METRICS},
            **{f"{m}_n": 4 for m in SERIES_METRICS},
        }
        for r in (0, 1)
    ]
    loss = views.series(rows, 10, abandoned)["metrics"]["loss"]
    assert loss["ranks"] == [[4.0, 2.0], [None, 3.0]]  # the last runs only
    assert loss["mean"] == [4.0, 2.5]
    assert loss["abandoned"] == [None, 9.0]  # the abandoned branch, where there is one
    assert loss["hi"] == [4.0, (10 * 3.0 + 36.0) / 14]  # the band still covers every run
    assert views.series(rows, 10)["metrics"]["loss"]["abandoned"] == [None, None]


def phases(rank: int, data=0.01, fwd=0.1, bwd=0.2, comm=0.05, opt=0.02) -> dict:
    return {
        "rank": rank,
        "node": "n",
        "data_time_s": data,
        "forward_time_s": fwd,
        "backward_time_s": bwd,
        "comm_time_s": comm,
        "optimizer_time_s": opt,
    }


def test_phase_bars_lay_phases_end_to_end_and_name_the_rank_everyone_waits_for():
    slow = phases(1, bwd=0.5, comm=0.0)  # the straggler: most compute, no waiting
    out = views.phase_bars([phases(0, comm=0.35), slow], width=100.0)
    assert out["waited_for"] == 1
    r1 = out["ranks"][1]
    assert [b["phase"] for b in r1["bars"]] == ["data", "forward", "backward", "comm", "optimizer"]
    assert math.isclose(r1["total_s"], 0.63) and math.isclose(out["scale_s"], 0.68)
    assert math.isclose(r1["bars"][2]["x"], 0.11 / 0.68 * 100) and r1["bars"][3]["w"] == 0.0
    assert views.phase_bars([]) == {"ranks": [], "scale_s": 0.0, "waited_for": None}


def test_gpu_cells_colour_by_metric_and_flag_sick_devices():
    sample = {
        "utilization_pct": 100.0,
        "memory_used_bytes": 40,
        "memory_total_bytes": 80,
        "temperature_c": 0.0,
        "power_w": None,
        "throttle_reasons": ["hw_slowdown"],
        "xid": None,
        "ecc_uncorrected": 0,
    }
    ok = {"healthy": True, "latest": sample}
    assert views.gpu_cell("utilization", ok) == {"colour": "hsl(0, 65%, 40%)", "text": "100%"}
    assert views.gpu_cell("memory", ok)["text"] == "50% mem"
    assert views.gpu_cell("temperature", ok)["colour"] == "hsl(120, 65%, 40%)"
    assert views.gpu_cell("power", ok)["text"] == "n/a"
    assert views.gpu_cell("throttle", ok)["text"] == "hw_slowdown"
    assert views.gpu_cell("health", ok)["text"] == "healthy"
    sick = {"healthy": False, "unhealthy_reason": "xid=79", "latest": sample | {"xid": 79}}
    assert views.gpu_cell("health", sick) == {"colour": "#c0392b", "text": "xid=79"}
    assert views.gpu_cell("utilization", {"healthy": True, "latest": None})["text"] == "no sample"


def test_topology_draws_each_nvlink_pair_once_and_highlights_a_jobs_devices():
    devices = [
        {"index": 0, "nvlink_peers": [1, 2], "job_id": "j1"},
        {"index": 1, "nvlink_peers": [0], "job_id": "j1"},
        {"index": 2, "nvlink_peers": [0, 9], "job_id": None},  # a peer the node does not report is skipped
    ]
    out = views.topology(devices)
    assert [(e["a"], e["b"], e["busy"]) for e in out["edges"]] == [(0, 1, True), (0, 2, False)]
    assert [n["busy"] for n in out["nodes"]] == [True, True, False]
    assert out["nodes"][0]["y"] < out["nodes"][1]["y"]  # the first device on top
    assert views.topology([{"index": 0, "nvlink_peers": []}])["edges"] == []


def test_the_step_trace_is_read_back_from_telemetrys_span_lines(tmp_path):
    trace_file = tmp_path / "traces.jsonl"
    provider = setup_tracing("telemetry", trace_file=trace_file)
    traces = StepTraces(provider, max_wait_s=0)
    t0 = datetime(2026, 1, 1, tzinfo=UTC)
    for step, attempt, extra in ((3, 1, 0.0), (4, 1, 0.0), (3, 2, 0.5)):  # step 3 ran again in attempt 2
        for rank in (0, 1):
            traces.add_step(
                step_completed(
                    "j-trace",
                    step,
                    rank,
                    attempt=attempt,
                    tokens=512,
                    tokens_per_s=1.0,
                    step_time_s=1.0,
                    data_time_s=0.1,
                    forward_time_s=0.2 + extra,
                    backward_time_s=0.3,
                    comm_time_s=0.1 * rank,
                    optimizer_time_s=0.05,
                    occurred_at=t0 + timedelta(seconds=10 * step + 100 * attempt),
                )
            )
    traces.flush(everything=True)
    provider.force_flush()
    rows = spans.read_step_spans(trace_file, "j-trace", 3, None)
    assert [r["rank"] for r in rows] == [0, 1] and {r["attempt"] for r in rows} == {2}  # the newest run
    assert math.isclose(rows[0]["forward_time_s"], 0.7, abs_tol=1e-6)
    assert math.isclose(rows[1]["comm_time_s"], 0.1, abs_tol=1e-6)
    assert [r["attempt"] for r in spans.read_step_spans(trace_file, "j-trace", 3, 1)] == [1, 1]
    assert spans.read_step_spans(trace_file, "j-other", 3, None) == []
    assert spans.read_step_spans(None, "j-trace", 3, None) is None


def test_a_hangs_stack_groups_are_listed_on_its_incident_and_other_incidents_list_none():
    def ranks(frames: list[StackFrame], *rs: int) -> list[RankStacks]:
        return [
            RankStacks(rank=r, pid=r, threads=[ThreadStack(name="MainThread", frames=frames)]) for r in rs
        ]

    c10d = "/v/lib/python3.11/site-packages/torch/distributed/distributed_c10d.py"
    waiting = [StackFrame(function="all_reduce", file=c10d, line=2501)]
    loader = [StackFrame(function="Loader.__next__", file="/code/data.py", line=88)]
    dump = StacksDumped(
        node="n", command_id="c", ranks=ranks(waiting, 0, 1, 2) + ranks(loader, 3), duration_s=0
    )
    evidence = {"silent_s": 3.0, "stacks": explain([dump], range(5)).evidence()}
    base = {
        "id": "i",
        "occurred_at": None,
        "kind": "hang",
        "action": "halt",
        "step": 4,
        "rank": 3,
        "node": "n",
    }
    (row,) = views.incident_rows([{**base, "message": "hang", "evidence": evidence}])
    assert row["stacks"] == [
        "rank 3 (outlier): in Loader.__next__ (data.py:88)",
        "ranks 0, 1, 2: wait in all_reduce (distributed_c10d.py:2501)",
        "rank 4: no stacks (its node sent no dump)",
    ]
    (failed,) = views.incident_rows(
        [{**base, "message": "hang", "evidence": {"stacks": {"error": "no dump came"}}}]
    )
    assert failed["stacks"] == ["no stacks: no dump came"]
    (nan,) = views.incident_rows([{**base, "kind": "nan", "message": "nan", "evidence": {"loss": "nan"}}])
    assert nan["stacks"] == []
