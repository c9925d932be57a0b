import math

from vigil_common.events import GpuSampled, IncidentRaised, JobStateChanged, StepCompleted
from vigil_telemetry.metrics import Registry


def test_exposition_text_from_events():
    r = Registry()
    r.observe(
        [
            StepCompleted(
                job_id="j-1",
                attempt=1,
                rank=0,
                node="n0",
                step=3,
                loss=math.nan,
                local_finite=False,
                lr=1e-3,
                tokens=1,
                tokens_per_s=123.5,
                step_time_s=0.25,
            ),
            GpuSampled(
                node="n0", index=1, device_kind="gpu", uuid="u", temperature_c=71.0, memory_used_bytes=5
            ),
            IncidentRaised(job_id="j-1", kind="nan", action="rollback", message="x"),
            IncidentRaised(job_id="j-1", kind="nan", action="rollback", message="y"),
        ]
    )
    text = r.render()
    assert "# TYPE vigil_step_loss gauge" in text
    assert 'vigil_step_loss{job="j-1",rank="0"} NaN' in text
    assert 'vigil_step_tokens_per_second{job="j-1",rank="0"} 123.5' in text
    assert 'vigil_step_last{job="j-1",rank="0"} 3' in text
    assert 'vigil_gpu_temperature_celsius{index="1",kind="gpu",node="n0"} 71' in text
    assert 'vigil_gpu_memory_used_bytes{index="1",kind="gpu",node="n0"} 5' in text
    assert 'vigil_incidents_total{action="rollback",kind="nan"} 2' in text
    assert "vigil_gpu_power_watts{" not in text  # no value, no series


def test_a_finished_jobs_gauges_go_away():
    r = Registry()
    r.observe(
        [
            StepCompleted(
                job_id="j-1",
                attempt=1,
                rank=0,
                node="n0",
                step=3,
                loss=1.0,
                local_finite=True,
                lr=1e-3,
                tokens=1,
                tokens_per_s=1.0,
                step_time_s=0.25,
            )
        ]
    )
    r.observe([JobStateChanged(job_id="j-1", from_state="RUNNING", to_state="SUCCEEDED", cause="done")])
    assert "vigil_step_loss{" not in r.render()
    assert 'vigil_steps_total{job="j-1"} 1' in r.render()


def test_label_values_are_escaped():
    r = Registry()
    r.set("vigil_step_loss", 1.0, job='a"b\\c', rank=0)
    assert 'job="a\\"b\\\\c"' in r.render()
