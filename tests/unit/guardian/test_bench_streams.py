"""The labelled streams of `vigil bench detectors`: deterministic, realistic, labelled as injected."""

from __future__ import annotations

import math
import random
import statistics

from vigil_bench import streams
from vigil_bench.streams import Label, clean, inject, suite


def test_a_seed_gives_the_same_streams():
    a = suite(3, steps=120, clean_jobs={0.03: 1}, small=True)
    b = suite(3, steps=120, clean_jobs={0.03: 1}, small=True)
    assert [(s.name, s.label, s.steps[-1][-1]) for s in a] == [(s.name, s.label, s.steps[-1][-1]) for s in b]


def test_a_clean_stream_falls_with_the_asked_noise_and_balanced_ranks():
    s = clean("c", random.Random(1), noise=0.03, steps=400)
    assert s.rank_steps == 400 * streams.WORLD and s.label.fault == "clean"
    first = statistics.mean(x.loss for x in s.steps[0])
    last = statistics.mean(x.loss for x in s.steps[-1])
    assert last < first  # a pre-training curve: the loss falls
    # per-rank noise around the cross-rank median: about the asked 3 %
    rel = [x.loss / statistics.median(y.loss for y in row) - 1 for row in s.steps for x in row]
    assert 0.015 < statistics.pstdev(rel) < 0.045
    # every rank waits in the all-reduce for the slowest: the step times agree
    for row in s.steps:
        times = [x.step_time_s for x in row]
        assert max(times) - min(times) < 1e-9
        assert all(x.comm_time_s >= streams.ALLREDUCE_S * 0.99 for x in row)


def test_a_nan_is_made_on_its_rank_and_seen_by_all_after_the_all_reduce():
    s = inject(
        clean("n", random.Random(2), noise=0.01, steps=100),
        Label("nan", 0.01, step=50, rank=1),
        random.Random(0),
    )
    row = s.steps[50]
    assert [x.local_finite for x in row] == [True, False, True, True]
    assert math.isnan(row[1].loss) and all(math.isfinite(x.loss) for i, x in enumerate(row) if i != 1)
    assert all(math.isnan(x.grad_norm) and x.skipped for x in row)
    assert s.label.step == row[0].step  # the label holds the step index, not the position


def test_a_straggler_computes_longer_and_the_others_wait():
    s = inject(
        clean("s", random.Random(4), noise=0.01, steps=100),
        Label("straggler", 0.01, step=20, rank=2),
        random.Random(0),
        slower=1.3,
    )
    row = s.steps[60]
    compute = [x.step_time_s - x.comm_time_s for x in row]
    assert max(range(4), key=lambda r: compute[r]) == 2
    assert min(range(4), key=lambda r: row[r].comm_time_s) == 2  # the straggler waits least


def test_a_hang_ends_the_stream_and_divergence_rises():
    h = inject(
        clean("h", random.Random(5), noise=0.01, steps=100), Label("hang", 0.01, step=40), random.Random(0)
    )
    assert len(h.steps) == 40
    d = inject(
        clean("d", random.Random(6), noise=0.01, steps=200),
        Label("divergence", 0.01, step=50),
        random.Random(0),
        rate=0.02,
    )
    assert statistics.median(x.loss for x in d.steps[-1]) > 2 * statistics.median(x.loss for x in d.steps[50])


def test_the_suite_holds_every_fault_and_enough_clean_rank_steps():
    full = suite(11, steps=400, clean_jobs={0.01: 20, 0.03: 64, 0.06: 20})
    rows = {s.label.row for s in full if s.label.fault != "clean"}
    assert {
        "nan",
        "inf",
        "skipped",
        "spike",
        "multi_spike",
        "grad_explosion",
        "hang",
        "straggler 15%",
        "straggler 30%",
        "divergence 0.2%/step",
        "divergence 2.0%/step",
    } <= rows
    clean3 = sum(s.rank_steps for s in full if s.label.fault == "clean" and s.label.noise == 0.03)
    assert clean3 >= 100_000
