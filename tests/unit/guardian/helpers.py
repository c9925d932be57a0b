"""Synthetic events for the guardian's unit tests."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any

from tests.helpers import step_completed
from vigil.events import GpuSampled, LaunchJob, RankPlacement, StepCompleted
from vigil.spec import JobSpec

T0 = datetime(2026, 1, 1, tzinfo=UTC)
JOB = "j-000000000001"


def at(seconds: float) -> datetime:
    return T0 + timedelta(seconds=seconds)


def step(
    step: int,
    rank: int = 0,
    loss: float = 2.0,
    *,
    t: float | None = None,
    attempt: int = 1,
    step_time: float = 0.1,
    comm: float = 0.01,
    **kw: Any,
) -> StepCompleted:
    return step_completed(
        kw.pop("job_id", JOB), step, rank, loss=loss, attempt=attempt, tokens=1024, tokens_per_s=1e4,
        step_time_s=step_time, comm_time_s=comm, occurred_at=at(step * step_time if t is None else t), **kw,
    )  # fmt: skip


def launch(
    world: int = 2,
    *,
    attempt: int = 1,
    t: float = 0.0,
    steps: int | None = None,
    checkpoint_every: int | None = None,
    **guardian: Any,
) -> LaunchJob:
    train = {} if steps is None else {"steps": steps}
    checkpoint = {} if checkpoint_every is None else {"every": checkpoint_every}
    spec = JobSpec(
        name="t",
        resources={"nodes": world, "gpus_per_node": 1},
        guardian=guardian,
        train=train,
        checkpoint=checkpoint,
    )
    return LaunchJob(
        job_id=JOB,
        attempt=attempt,
        occurred_at=at(t),
        spec=spec,
        placement=[RankPlacement(rank=r, node=f"n{r}", device=0, local_rank=0) for r in range(world)],
        master_addr="127.0.0.1",
        master_port=29500,
    )


def gpu(**kw: Any) -> GpuSampled:
    base: dict[str, Any] = dict(
        node="n0",
        index=0,
        device_kind="gpu",
        uuid="GPU-0",
        temperature_c=60.0,
        memory_used_bytes=10,
        memory_total_bytes=100,
        occurred_at=T0,
    )
    return GpuSampled(**{**base, **kw})
