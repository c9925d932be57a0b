"""What `vigil bench fleet` says holds a run back, from its samples (no servers)."""

from __future__ import annotations

from vigil_bench.fleet_watch import Watch, holding_back


def watch(backlogs: dict[str, list[int]], cpu_per_s: dict[str, float]) -> Watch:
    w = Watch(t0=0.0, cpu0={k: 0.0 for k in cpu_per_s})
    n = len(next(iter(backlogs.values())))
    for i in range(n):
        t = (i + 1) * 0.5
        w.samples.append(
            (t, {k: v[i] for k, v in backlogs.items()}, {k: r * t for k, r in cpu_per_s.items()})
        )
    return w


def test_a_growing_backlog_a_pegged_process_and_a_slow_consumer_are_named() -> None:
    w = watch(
        {"telemetry-steps": [0, 10, 0, 500, 900, 2000], "scheduler-heartbeats": [0, 3, 0, 2, 0, 1]},
        {"telemetry-0": 0.95, "scheduler": 0.05},
    )
    assert w.consumer("telemetry-steps")["growing"] and not w.consumer("scheduler-heartbeats")["growing"]
    found = holding_back(
        1.0, w, {"telemetry-0": 2.85, "scheduler": 0.15}, 3.0, [{"p99_late_s": 0.01}],
        {"telemetry-0": {"slow_consumer": 4, "errors": 0, "warnings": 4}}, 0, 1.5,
    )  # fmt: skip
    text = "\n".join(found)
    assert "telemetry-steps: backlog growing" in text
    assert "telemetry-0: 95% of a core" in text
    assert "telemetry-0: 4 slow-consumer drops" in text
    assert "scheduler" not in text and "guardian" not in text  # nothing said of what kept up


def test_a_consumer_never_caught_up_and_a_slow_guardian_are_named() -> None:
    w = watch(
        {
            "telemetry-status": [900, 800, 700, 600, 500, 400],
            "guardian-steps": [0, 50, 0, 20, 0, 10],
            "telemetry-steps": [9, 50, 20, 30, 12, 40],  # a steady flow: a batch always pending
        },
        {},
    )
    found = holding_back(1.0, w, {"guardian": 0.6}, 3.0, [], {}, 2, 7.0)
    text = "\n".join(found)
    assert "telemetry-status: never caught up, backlog 400 to 900" in text
    assert "guardian: 2 probes" in text and "guardian: detect-to-command p99 7x idle" in text
    assert "telemetry-steps" not in text


def test_the_timeline_gives_each_processs_share_of_a_core_between_points() -> None:
    w = watch({"telemetry-steps": [5] * 40}, {"guardian": 0.25})
    points = w.timeline(every_s=10.0)
    assert [p["t"] for p in points] == [10.0, 20.0]
    assert all(p["cpu"]["guardian"] == 0.25 and p["backlog"] == {"telemetry-steps": 5} for p in points)
