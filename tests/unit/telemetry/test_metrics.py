import math
from typing import get_args

from tests.helpers import step_completed
from tests.unit.common.samples import SAMPLES
from vigil import events as ev
from vigil.events import GpuSampled, IncidentRaised, JobStateChanged
from vigil_telemetry.metrics import Registry


def test_exposition_text_from_events():
    r = Registry()
    r.observe(
        [
            step(0, 3, math.nan, tokens_per_s=123.5, step_time_s=0.25),
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
    r.observe([step(0, 3, 1.0, tokens_per_s=1.0, step_time_s=0.25)])
    assert 'vigil_steps_total{job="j-1"} 1' in r.render()
    r.observe([JobStateChanged(job_id="j-1", from_state="RUNNING", to_state="SUCCEEDED", cause="done")])
    assert 'job="j-1"' not in r.render()  # every series of an ended job goes: cardinality stays bounded


def test_label_values_are_escaped():
    r = Registry()
    r.set("vigil_step_loss", 1.0, job='a"b\\c', rank=0)
    assert 'job="a\\"b\\\\c"' in r.render()


def step(rank: int, step: int, loss: float, tokens_per_s: float, step_time_s: float, job: str = "j-1"):
    return step_completed(
        job, step, rank, loss=loss, node="n0", tokens_per_s=tokens_per_s, step_time_s=step_time_s
    )


def test_a_jobs_gauges_come_from_its_ranks_newest_steps():
    r = Registry()
    r.observe([step(0, 4, 2.0, 100.0, 0.5), step(1, 4, 4.0, 80.0, 0.25), step(0, 5, 1.0, 120.0, 0.2)])
    assert r.get("vigil_job_step", job="j-1") == 5
    assert r.get("vigil_job_loss", job="j-1") == 2.5  # rank 0 at step 5, rank 1 at step 4
    assert r.get("vigil_job_tokens_per_second", job="j-1") == 200.0
    assert r.get("vigil_job_steps_per_second", job="j-1") == 4.0  # the slowest rank's newest step
    assert r.get("vigil_steps_total", job="j-1") == 3


def test_a_jobs_gauges_come_from_its_own_ranks_only_across_batches_and_a_rerun():
    r = Registry()
    r.observe([step(0, 1, 2.0, 100.0, 0.5, job="a"), step(0, 1, 8.0, 10.0, 0.5, job="b")])
    r.observe([step(1, 1, 4.0, 100.0, 0.5, job="a")])  # a's rank 0 is remembered from the batch before
    assert r.get("vigil_job_loss", job="a") == 3.0
    assert r.get("vigil_job_loss", job="b") == 8.0
    r.forget_job("a")
    r.observe([step(0, 1, 6.0, 100.0, 0.5, job="a")])  # a job id seen again starts from its new ranks
    assert r.get("vigil_job_loss", job="a") == 6.0
    assert r.get("vigil_job_tokens_per_second", job="a") == 100.0


def test_incidents_count_per_job_and_overall():
    r = Registry()
    r.observe(
        [
            IncidentRaised(job_id="j-1", kind="spike", action="rollback", message="x"),
            IncidentRaised(job_id="j-2", kind="spike", action="rollback", message="y"),
        ]
    )
    assert r.get("vigil_incidents_total", kind="spike", action="rollback") == 2
    assert r.get("vigil_job_incidents_total", job="j-1", kind="spike", action="rollback") == 1


def test_late_events_of_an_ended_job_make_no_series():
    r = Registry()
    r.observe([JobStateChanged(job_id="j-1", from_state="RUNNING", to_state="CANCELLED", cause="user")])
    r.observe(
        [step(0, 9, 1.0, 1.0, 0.1), IncidentRaised(job_id="j-1", kind="hang", action="halt", message="")]
    )
    assert 'job="j-1"' not in r.render()
    assert r.get("vigil_incidents_total", kind="hang", action="halt") == 1


def test_every_sampled_gpu_field_is_a_series_and_throttling_clears():
    r = Registry()
    sample = dict(node="n0", index=0, device_kind="gpu", uuid="u", sm_clock_mhz=1980, mem_clock_mhz=2619,
                  ecc_corrected=3, ecc_uncorrected=0, power_w=612.5, utilization_pct=97.0)  # fmt: skip
    r.observe([GpuSampled(**sample, throttle_reasons=["sw_power_cap"])])
    gpu = {"node": "n0", "index": 0, "kind": "gpu"}
    assert r.get("vigil_gpu_sm_clock_mhz", **gpu) == 1980
    assert r.get("vigil_gpu_memory_clock_mhz", **gpu) == 2619
    assert r.get("vigil_gpu_ecc_corrected", **gpu) == 3 and r.get("vigil_gpu_ecc_uncorrected", **gpu) == 0
    assert r.get("vigil_gpu_power_watts", **gpu) == 612.5
    assert r.get("vigil_gpu_throttled", reason="sw_power_cap", **gpu) == 1
    r.observe([GpuSampled(**sample)])
    assert r.get("vigil_gpu_throttled", reason="sw_power_cap", **gpu) == 0


def test_every_event_telemetry_stores_has_its_branch_in_observe():
    r = Registry()
    r.observe([SAMPLES[cls] for cls in get_args(ev.TelemetryInput)])  # none reaches assert_never
    assert r.get("vigil_incidents_total", kind="hang", action="restart") == 1
