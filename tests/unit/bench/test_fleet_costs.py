"""`vigil bench fleet`'s cost lines, the size the machine carries, the sizing table, and its plan (no servers)."""

from __future__ import annotations

import pytest

from vigil_bench.fleet import _auto_nodes
from vigil_bench.fleet_costs import by_service, costs, fit, ranks_at_busy, render, sizing
from vigil_bench.fleet_plan import AUTO, Plan, Window
from vigil_bench.fleet_probes import Stages
from vigil_bench.fleet_watch import Watch


def test_a_line_separates_a_fixed_cost_from_a_per_rank_one() -> None:
    # 0.05 cores with no fleet, 0.3 per 1,000 ranks: the mean per rank would say 0.4-0.7 instead
    f = fit([(128, 0.05 + 0.3 * 0.128), (384, 0.05 + 0.3 * 0.384), (1024, 0.05 + 0.3 * 1.024)])
    assert f.per_1000_ranks == pytest.approx(0.3) and f.fixed == pytest.approx(0.05)
    assert f.worst_residual == pytest.approx(0.0, abs=1e-9)
    assert f.at(10_000) == pytest.approx(3.05)


def test_a_bent_line_shows_in_its_residual() -> None:
    f = fit([(100, 0.1), (200, 0.2), (300, 0.6)])
    assert f.worst_residual > 0.1
    assert f.summary()["measured"] == {"100": 0.1, "200": 0.2, "300": 0.6}


def test_one_size_is_no_line() -> None:
    with pytest.raises(ValueError, match=r"two or more distinct fleet sizes, got ranks \[128, 128\]"):
        fit([(128, 0.1), (128, 0.2)])


def test_processes_are_grouped_as_services_are_sized() -> None:
    grouped = by_service({
        "guardian-0": 0.2, "guardian-1": 0.3, "telemetry-0": 0.1, "telemetry-1": 0.15,
        "simulator-0": 0.2, "simulator-1": 0.1, "nats-server": 0.5, "postgres": 0.2, "bench": 0.05,
    })  # fmt: skip
    assert grouped["guardians"] == pytest.approx(0.5) and grouped["guardian-1"] == 0.3
    assert grouped["telemetry"] == pytest.approx(0.25) and grouped["simulator"] == pytest.approx(0.3)
    assert grouped["nats-server"] == 0.5 and grouped["bench"] == 0.05


def sizes(per_1000: dict[str, float], fixed: float = 0.02) -> list[tuple[int, dict[str, float]]]:
    return [(r, {k: fixed + v * r / 1000 for k, v in per_1000.items()}) for r in (128, 384, 1000)]


def test_the_total_counts_each_process_once_and_gives_the_size_at_a_busy_share() -> None:
    fits = costs(sizes({"guardian-0": 0.1, "guardian-1": 0.1, "nats-server": 0.3, "simulator-0": 0.3}))
    assert fits["guardians"].per_1000_ranks == pytest.approx(0.2)
    # the guardians' sum is not counted again: 0.8 per 1,000 ranks, 4 x 0.02 fixed
    assert fits["total"].per_1000_ranks == pytest.approx(0.8) and fits["total"].fixed == pytest.approx(0.08)
    assert ranks_at_busy(fits["total"], cores=2, busy=0.6) == int((1.2 - 0.08) / 0.8 * 1000)
    assert ranks_at_busy(fits["total"], cores=1, busy=0.05) == 0  # the fixed cost alone is over it
    with pytest.raises(ValueError, match="busy must be a share of the cores"):
        ranks_at_busy(fits["total"], cores=2, busy=60)


def test_the_sizing_table_marks_what_was_measured_and_what_extrapolated() -> None:
    fits = costs(sizes({"nats-server": 0.3, "guardian-0": 0.1, "telemetry-0": 0.2, "postgres": 0.1}))
    table = sizing(fits, gpus=(1_000, 10_000, 100_000))
    assert list(table) == ["nats-server", "guardians", "telemetry", "postgres"]  # the simulator is not Vigil
    assert table["nats-server"]["1000"] == {"cores": 0.32, "how": "measured"}
    assert table["nats-server"]["10000"] == {"cores": 3.02, "how": "extrapolated"}
    assert table["telemetry"]["100000"] == {"cores": 20.02, "how": "extrapolated"}
    rows = [
        {"ranks": r, "cpu_per_s": cpu, "busy": 0.3, "p99_ms": 5.0, "ratio": 1.2, "backlog_growing": []}
        for r, cpu in sizes({"nats-server": 0.3, "guardian-0": 0.1, "telemetry-0": 0.2, "postgres": 0.1})
    ]
    text = render(rows, fits, table)
    assert "| nats-server | 0.300 | 0.020 | 0% |" in text
    assert "| nats-server | 0.32 m | 3.02 e | 30.02 e |" in text


def test_the_plan_reads_sizes_and_says_what_is_wrong(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("VIGIL_BENCH_FLEET_SIZES", "8, 24,auto")
    monkeypatch.setenv("VIGIL_BENCH_FLEET_STRESS", "1")
    plan = Plan.from_env()
    assert plan.sizes == (8, 24, AUTO) and plan.stress and plan.busy == 0.6
    for bad, says in (
        ("8,auto", "two sizes at least"),
        ("24,8", "must increase"),
        ("auto,8,24", "only be the last"),
        ("8,x", "comma-separated node counts"),
        ("0,8", "1 or more"),
    ):
        monkeypatch.setenv("VIGIL_BENCH_FLEET_SIZES", bad)
        with pytest.raises(ValueError, match=says):
            Plan.from_env()
    monkeypatch.setenv("VIGIL_BENCH_FLEET_SIZES", "8,24")
    monkeypatch.setenv("VIGIL_BENCH_FLEET_STRESS", "yes")
    with pytest.raises(ValueError, match="VIGIL_BENCH_FLEET_STRESS=yes"):
        Plan.from_env()
    monkeypatch.setenv("VIGIL_BENCH_FLEET_STRESS", "0")
    monkeypatch.setenv("VIGIL_BENCH_FLEET_NODES", "256")
    with pytest.raises(ValueError, match="VIGIL_BENCH_FLEET_NODES is gone: set VIGIL_BENCH_FLEET_SIZES"):
        Plan.from_env()


def window(nodes: int, cores_per_s: dict[str, float], backlog: list[int] | None = None) -> Window:
    watch = Watch(t0=0.0, cpu0={})
    for i, b in enumerate(backlog or [0]):
        watch.samples.append(((i + 1) * 0.5, {"telemetry-steps": b}, {}))
    return Window(
        nodes=nodes, step_hz=1.0, elapsed=10.0, cpu_s={k: v * 10 for k, v in cores_per_s.items()},
        watch=watch, probes=[0.004, 0.006], stages=Stages(), stored=nodes * 8 * 10, db_bytes=0,
        judged={}, offered={}, machine_busy=0.5, loadavg=[1.0, 1.0, 1.0],
    )  # fmt: skip


def test_auto_is_the_most_nodes_the_line_keeps_within_the_busy_share() -> None:
    # everything: 0.1 cores fixed + 1 core per 1,000 ranks; 60 % of 2 cores at 1,100 ranks
    def cores(ranks: int) -> dict[str, float]:
        return {"nats-server": 0.05 + 0.6 * ranks / 1000, "simulator-0": 0.05 + 0.4 * ranks / 1000}

    windows = [window(16, cores(128)), window(48, cores(384))]
    assert _auto_nodes(Plan(), windows, cores=2) == 1100 // 8
    assert _auto_nodes(Plan(busy=0.3), windows, cores=2) == 500 // 8
    cheap = [window(16, {"nats-server": 0.01}), window(48, {"nats-server": 0.011})]
    assert _auto_nodes(Plan(), cheap, cores=2) == 256  # at most the stress size


def test_a_window_says_its_busy_share_and_which_backlog_grew() -> None:
    w = window(4, {"nats-server": 0.3, "simulator-0": 0.1}, backlog=[0, 10, 0, 40, 90, 120])
    assert w.busy(cores=2) == pytest.approx(0.2) and w.rate == 32 and w.rate_held
    assert w.growing() == ["telemetry-steps"]  # last third 105 > 2 x first 5, and over 32 events (1 s)
    s = w.summary(idle_p99=0.002, cores=2)
    assert s["ranks"] == 32 and s["p99_ms"] == 6.0 and s["ratio"] == 3.0 and s["busy"] == 0.2
    quick = window(64, {}, backlog=[0, 10, 0, 40, 150, 200])  # 512 step events a second
    assert quick.watch.consumer("telemetry-steps")["growing"] and quick.growing() == []  # under 1 s of steps
    missed = window(4, {})
    missed.probes.append(None)
    assert missed.summary(0.002, 2)["p99_ms"] is None and missed.summary(0.002, 2)["probes_missed"] == 1
