from datetime import UTC, datetime, timedelta

import pytest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from tests.helpers import step_completed
from vigil.events import CheckpointSaved, LaunchJob, RankPlacement
from vigil.spec import JobSpec
from vigil_telemetry.traces import StepTraces

T0 = datetime(2026, 1, 1, tzinfo=UTC)
JOB = "j-0000000000aa"


@pytest.fixture
def exporter():
    return InMemorySpanExporter()


@pytest.fixture
def traces(exporter):
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    return StepTraces(provider, max_wait_s=60)


def step(k, rank, end_s):
    return step_completed(
        JOB, k, rank, loss=2.0 + rank, attempt=2, tokens=10, tokens_per_s=100.0, data_time_s=0.1,
        forward_time_s=0.2, backward_time_s=0.3, comm_time_s=0.15, optimizer_time_s=0.05, step_time_s=0.8,
        occurred_at=T0 + timedelta(seconds=end_s),
    )  # fmt: skip


def launch(world):
    return LaunchJob(
        job_id=JOB,
        attempt=2,
        spec=JobSpec(name="t", resources={"nodes": 1, "gpus_per_node": world}),
        placement=[RankPlacement(rank=r, node=f"n{r}", device=r, local_rank=r) for r in range(world)],
        master_addr="h",
        master_port=1,
    )


def test_one_trace_per_step_with_phase_spans_from_measured_times(traces, exporter):
    traces.launch(launch(2))
    traces.add_step(step(4, 0, 10.0))
    assert exporter.get_finished_spans() == ()  # waits for the other rank
    traces.add_step(step(4, 1, 10.5))
    spans = exporter.get_finished_spans()
    roots = [s for s in spans if s.name == "train.step"]
    assert len(roots) == 1
    root = roots[0]
    assert root.parent is None
    assert (
        dict(root.attributes).items()
        >= {
            "vigil.job_id": JOB,
            "vigil.attempt": 2,
            "vigil.step": 4,
            "vigil.ranks": 2,
        }.items()
    )
    children = [s for s in spans if s.name != "train.step"]
    assert {s.context.trace_id for s in spans} == {root.context.trace_id}
    assert all(s.parent.span_id == root.context.span_id for s in children)
    assert sorted(s.name for s in children) == sorted(
        ["data", "forward", "backward", "communication", "optimizer"] * 2
    )
    rank1 = sorted((s for s in children if s.attributes["vigil.rank"] == 1), key=lambda s: s.start_time)
    assert [s.name for s in rank1] == ["data", "forward", "backward", "communication", "optimizer"]
    assert [round((s.end_time - s.start_time) / 1e9, 3) for s in rank1] == [0.1, 0.2, 0.3, 0.15, 0.05]
    start = (T0 + timedelta(seconds=10.5 - 0.8)).timestamp()
    assert rank1[0].start_time / 1e9 == pytest.approx(start, abs=1e-6)
    # the root spans the earliest rank start to the latest rank end
    assert root.start_time / 1e9 == pytest.approx((T0 + timedelta(seconds=9.2)).timestamp(), abs=1e-6)
    assert root.end_time / 1e9 == pytest.approx((T0 + timedelta(seconds=10.5)).timestamp(), abs=1e-6)


def test_checkpoint_span_joins_the_step_it_follows(traces, exporter):
    traces.launch(launch(1))
    traces.add_checkpoint(
        CheckpointSaved(
            job_id=JOB,
            attempt=2,
            step=5,
            path="/c/5",
            bytes=1,
            manifest_sha256="x",
            data_position=5,
            occurred_at=T0 + timedelta(seconds=3),
        ),
    )  # the step's trace is out already -> a trace of its own
    assert [s.name for s in exporter.get_finished_spans()] == ["checkpoint"]
    exporter.clear()
    traces.launch(launch(2))
    traces.add_step(step(9, 0, 20.0))
    traces.add_checkpoint(
        CheckpointSaved(
            job_id=JOB,
            attempt=2,
            step=10,
            path="/c/10",
            bytes=1,
            manifest_sha256="x",
            data_position=10,
            occurred_at=T0 + timedelta(seconds=21),
        ),
    )
    traces.add_step(step(9, 1, 20.1))
    spans = exporter.get_finished_spans()
    root = next(s for s in spans if s.name == "train.step")
    ckpt = next(s for s in spans if s.name == "checkpoint")
    assert ckpt.parent.span_id == root.context.span_id and ckpt.attributes["vigil.checkpoint_step"] == 10
    assert root.end_time >= ckpt.end_time


def test_incomplete_steps_are_flushed_after_the_wait(traces, exporter):
    traces.add_step(step(1, 0, 1.0))  # world size unknown: no launch seen
    traces.flush()
    assert exporter.get_finished_spans() == ()
    traces.flush(everything=True)
    assert len([s for s in exporter.get_finished_spans() if s.name == "train.step"]) == 1
