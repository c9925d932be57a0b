"""One fully populated sample per event class, with fixed ids and times (the golden files' source)."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

from vigil import events as ev
from vigil.spec import GuardianSpec, JobSpec

T0 = datetime(2026, 1, 2, 3, 4, 5, 678000, tzinfo=UTC)
BASE: dict[str, Any] = {"event_id": "0123456789abcdef0123456789abcdef", "occurred_at": T0}
JOB: dict[str, Any] = {**BASE, "job_id": "j-0123456789ab", "attempt": 2}

STEP_V1 = ev.StepCompletedV1(
    **JOB,
    rank=1,
    node="n1",
    step=41,
    loss=2.5,
    grad_norm=0.75,
    lr=3e-4,
    tokens=1024,
    tokens_per_s=8000.0,
    data_time_s=0.001,
    forward_time_s=0.02,
    backward_time_s=0.04,
    comm_time_s=0.01,
    optimizer_time_s=0.005,
    step_time_s=0.08,
    mem_allocated_bytes=1 << 20,
    mem_peak_bytes=2 << 20,
    skipped=False,
    data_position=41,
)
# v2: the same step as v1's sample, with what v2 adds
STEP_V2 = ev.StepCompletedV2(
    **STEP_V1.model_dump(exclude={"schema_version"}),
    local_finite=True,
    flops_per_token=2.0e7,
    mfu=0.41,
    micro_batch=4,
)

SAMPLES: dict[type[ev.Message], ev.Message] = {
    ev.NodeHeartbeat: ev.NodeHeartbeat(
        **BASE,
        node="n1",
        address="10.0.0.1",
        devices=[
            ev.Device(
                index=0, kind="gpu", name="NVIDIA H100", uuid="GPU-1", memory_bytes=80 << 30, nvlink_peers=[1]
            )
        ],
        free=[0],
        interval_s=2.0,
        started_at=T0,
    ),
    ev.GpuSampled: ev.GpuSampled(
        **BASE,
        node="n1",
        index=0,
        device_kind="gpu",
        uuid="GPU-1",
        utilization_pct=97.0,
        memory_used_bytes=1 << 30,
        memory_total_bytes=80 << 30,
        temperature_c=61.0,
        power_w=420.5,
        sm_clock_mhz=1980,
        mem_clock_mhz=2619,
        throttle_reasons=["sw_power_cap"],
        ecc_corrected=0,
        ecc_uncorrected=0,
        xid=None,
    ),
    ev.LaunchJob: ev.LaunchJob(
        **JOB,
        spec=JobSpec(
            name="tiny-gpt", guardian={"divergence_tolerance": 0.5}
        ),  # as sent before its default became 0.1
        placement=[ev.RankPlacement(rank=0, node="n1", device=0, local_rank=0)],
        master_addr="10.0.0.1",
        master_port=29500,
        resume_from=None,
        skip_data=None,
    ),
    ev.StepCompletedV1: STEP_V1,
    ev.StepCompletedV2: STEP_V2,
    # v3: the same step as v2's sample, re-run after one in-place rollback
    ev.StepCompleted: STEP_V2.upgraded().model_copy(update=dict(generation=1)),
    ev.RankStarted: ev.RankStarted(**JOB, rank=0, node="n1", pid=4242, log_path="/var/log/vigil/r0.log"),
    ev.RankExited: ev.RankExited(
        **JOB, rank=0, node="n1", exit_code=3, signal=None, failure="error", last_step=12, log_tail="boom"
    ),
    ev.CheckpointSaved: ev.CheckpointSaved(
        **JOB,
        step=20,
        path="/ckpt/j/step_00000020",
        bytes=123456,
        manifest_sha256="ab" * 32,
        data_position=20,
    ),
    ev.RanksHalted: ev.RanksHalted(**JOB, step=13, command_id="c1", node="n1"),
    ev.RollbackCompleted: ev.RollbackCompleted(
        **JOB,
        from_step=13,
        to_step=10,
        checkpoint="/ckpt/j/step_00000010",
        skip_data=(12, 13),
        command_id="c2",
        duration_s=0.4,
        node="n1",
    ),
    ev.JobStateChanged: ev.JobStateChanged(
        **JOB, from_state="RUNNING", to_state="HALTED", cause="nan at step 12"
    ),
    ev.GuardianSettingsChanged: ev.GuardianSettingsChanged(
        **JOB,
        revision=1,
        settings=GuardianSpec(spike_zscore=4.0, spike="halt"),
        changed={"spike_zscore": 4.0, "spike": "halt"},
        by="user:alice",
    ),
    ev.HaltJob: ev.HaltJob(**JOB, reason="nan at step 12", incident_id="i1"),
    ev.RollbackJobV1: ev.RollbackJobV1(
        **JOB,
        checkpoint="/ckpt/j/step_00000010",
        step=10,
        skip_data=(12, 13),
        restart=False,
        reason="spike",
        incident_id="i2",
    ),
    ev.RollbackJob: ev.RollbackJob(
        **JOB,
        checkpoint="/ckpt/j/step_00000010",
        step=10,
        skip_data=(12, 13),
        reason="spike",
        incident_id="i2",
    ),
    ev.RestartJob: ev.RestartJob(
        **JOB,
        checkpoint="/ckpt/j/step_00000010",
        step=10,
        skip_data=None,
        reason="hang",
        incident_id="i3",
        unhealthy=[("n1", 1)],
    ),
    ev.RestartRequested: ev.RestartRequested(
        **JOB, checkpoint="/ckpt/j/step_00000010", step=10, skip_data=(12, 13), command_id="c2", node="n1"
    ),
    ev.OutOfMemoryHalted: ev.OutOfMemoryHalted(
        **JOB,
        step=12,
        rank=1,
        node="n1",
        micro_batch=4,
        grad_accum=2,
        checkpoint_step=12,
        message="rank 1 ran out of memory at step 12 with micro-batch 4",
    ),
    ev.StepReplayed: ev.StepReplayed(
        **JOB,
        step=12,
        node="n1",
        kind="spike",
        outcome="transient",
        culprits=[1],
        values=[ev.RankValue(rank=1, first=120.5, replay=2.41)],
        data_position=12,
        held_s=0.25,
        evidence={"threshold": 6.0},
    ),
    ev.ReportRefused: ev.ReportRefused(
        **JOB,
        rank=1,
        node="n1",
        report="ranks.step_replayed",
        field="culprits",
        reason="culprits: rank 70000 is not a rank of this job (world size 2)",
        refused=3,
    ),
    ev.CheckpointRefused: ev.CheckpointRefused(
        **JOB,
        step=10,
        path="/ckpt/j/step_00000010",
        reason="load",
        message="Weights only load failed",
        node="n1",
    ),
    ev.DeviceDiagnosed: ev.DeviceDiagnosed(
        **JOB,
        node="n1",
        device=1,
        passed=False,
        checks={"matmul": 0.25, "repeat": 0.0, "reduce": 0.0},
        duration_s=0.5,
        command_id="c3",
    ),
    ev.StacksDumped: ev.StacksDumped(
        **JOB,
        node="n1",
        command_id="inc-0123456789abcdef0123456789ab-stacks",
        ranks=[
            ev.RankStacks(
                rank=1,
                pid=4242,
                tool="py-spy",
                threads=[
                    ev.ThreadStack(
                        name="MainThread",
                        frames=[
                            ev.StackFrame(
                                function="Event.wait", file="/usr/lib/python3.11/threading.py", line=629
                            ),
                            ev.StackFrame(function="Loader.__next__", file="/code/byo/data.py", line=88),
                        ],
                    )
                ],
            ),
            ev.RankStacks(rank=3, pid=4243, error="py-spy: Permission denied (os error 13)"),
        ],
        duration_s=0.12,
    ),
    ev.DumpStacks: ev.DumpStacks(
        **JOB, within_s=2.0, reason="hang: no step from rank 1 on n1 for 3.2s (limit 1.0s; last step 4)"
    ),
    ev.DiagnoseDevice: ev.DiagnoseDevice(
        **JOB, node="n1", device=1, reason="rank 1 reported a transient fault at step 12"
    ),
    ev.ResumeJob: ev.ResumeJob(**JOB, reason="operator"),
    ev.CancelJob: ev.CancelJob(**JOB, reason="user"),
    ev.PreemptJob: ev.PreemptJob(
        **JOB,
        kind="preempt",
        reason="preempted by j-fedcba987654 (priority 50 > 10): needs 4 GPUs",
        by_job="j-fedcba987654",
    ),
    ev.IncidentRaisedV1: ev.IncidentRaisedV1(
        **JOB,
        kind="spike",
        action="rollback",
        step=12,
        rank=0,
        node="n1",
        device=None,
        message="loss 40.1 is 9.3 MADs above the median 2.4",
        evidence={"z": 9.3, "median": 2.4},
    ),
    ev.IncidentRaised: ev.IncidentRaised(
        **JOB,
        kind="hang",
        action="restart",
        step=5,
        rank=1,
        node="n2",
        device=None,
        message="hang: no step from rank 1 on n2 for 3.2s (limit 1.0s; last step 4)",
        evidence={"checkpoint_step": 4, "restart": True},
    ),
    ev.MessageDeadLettered: ev.MessageDeadLettered(
        **BASE,
        stream="VIGIL_STEPS",
        consumer="telemetry-steps",
        subject="vigil.job.j1.step",
        reason="MalformedMessage: not JSON",
        payload="{oops",
        num_delivered=1,
    ),
}
