"""The guardian's section of the job spec (`guardian:`): what it does about each fault, and its
detectors' settings. Re-exported by `vigil.spec`."""

from __future__ import annotations

from pydantic import Field, model_validator

from vigil.spec_base import Action, FieldError, StrictModel

DEFAULT_HANG_FLOOR_S = 5.0  # a checkpoint save or an evaluation can take many times a sub-second step
DEFAULT_STARTUP_TIMEOUT_S = 600.0  # loading a 70B checkpoint, NCCL's start across hundreds of nodes: minutes
# Once a job has measured a start-up, its limit is learned (`vigil_guardian.hang.startup_limit`):
STARTUP_MULTIPLE = 3.0  # k x the job's longest measured start-up,
STARTUP_FLOOR_S = 60.0  # never under this (a warm first start-up, then a cold relaunch that imports),
CHECKPOINT_READ_BYTES_S = 200e6  # nor under the time its checkpoint takes to read (and hash) at this rate


class GuardianSpec(StrictModel):
    nan: Action = "rollback"
    spike: Action = "rollback"
    divergence: Action = "rollback"
    imbalance: Action = "alert"
    straggler: Action = "alert"
    hang: Action = "rollback"
    gpu_health: Action = "alert"
    hang_timeout_s: float = Field(
        60.0,
        gt=0,
        le=86_400,
        description="hung after this long without a step, whatever the step time (once a rank has made its "
        "first step of the attempt: before, `startup_timeout_s`), and a rollback after this long",
    )
    hang_step_multiple: float = Field(
        10.0,
        ge=2,
        le=10_000,
        description="k: also hung after k x the job's p99 step time (over `hang_window`) without a step",
    )
    hang_floor_s: float | None = Field(
        None,
        gt=0,
        le=86_400,
        description="the step-time limit never judges a shorter silence a hang (a save, an evaluation); "
        f"null: {DEFAULT_HANG_FLOOR_S:g} s, or hang_timeout_s if that is shorter",
    )
    hang_window: int = Field(100, ge=10, le=10_000, description="the steps the p99 step time is taken over")
    startup_timeout_s: float = Field(
        DEFAULT_STARTUP_TIMEOUT_S,
        gt=0,
        le=7 * 86_400,
        description="an attempt's start-up (from its launch to each rank's first step: imports, the process "
        "group, building the engine, loading the checkpoint) is hung after this long; once the job has "
        f"measured a start-up, the limit is the shorter of this and {STARTUP_MULTIPLE:g} x its longest "
        f"start-up (at least {STARTUP_FLOOR_S:g} s), and never under the time its checkpoint takes to read "
        f"at {CHECKPOINT_READ_BYTES_S / 1e6:g} MB/s. Step times never judge a start-up",
    )
    max_rollbacks: int = Field(3, ge=0, le=1000)
    spike_zscore: float = Field(6.0, gt=0, le=1e6, description="robust z-score over the rolling median/MAD")
    spike_window: int = Field(50, ge=5, le=10_000)
    spike_warmup: int = Field(10, ge=1, le=10_000_000, description="steps seen before spikes are judged")
    spike_skip_steps: int = Field(
        1, ge=0, le=10_000, description="data window skipped after a spike or NaN the data reproduces"
    )
    replay: bool = Field(
        True,
        description="the built-in trainer holds a NaN or spike step whose action is rollback and replays "
        "it once in place: clean, a transient fault (the device gets a strike); reproduced, the data "
        "window is skipped; bad again right after a skip, a rollback",
    )
    sdc: Action = Field("rollback", description="a device with sdc_strikes strikes: relaunch without it")
    sdc_strikes: int = Field(2, ge=1, le=1000, description="transient faults that mark a device unhealthy")
    sdc_window: int = Field(10_000, ge=1, le=100_000_000, description="steps over which strikes count")
    divergence_window: int = Field(50, ge=5, le=100_000)
    divergence_tolerance: float = Field(
        0.1,
        gt=0,
        le=1e6,
        description="relative rise of the loss trend across the window (and a significant one)",
    )
    imbalance_threshold: float = Field(0.2, gt=0, lt=10)
    imbalance_steps: int = Field(5, ge=1, le=10_000)

    @property
    def hang_floor(self) -> float:
        """The floor in effect: `hang_floor_s`, else 5 s (never above `hang_timeout_s`)."""
        if self.hang_floor_s is not None:
            return self.hang_floor_s
        return min(DEFAULT_HANG_FLOOR_S, self.hang_timeout_s)

    @model_validator(mode="after")
    def _floor_below_timeout(self) -> GuardianSpec:
        if self.hang_floor_s is not None and self.hang_floor_s > self.hang_timeout_s:
            raise FieldError(
                "guardian.hang_floor_s",
                f"guardian.hang_floor_s ({self.hang_floor_s:g}) exceeds guardian.hang_timeout_s "
                f"({self.hang_timeout_s:g}): the floor is the shortest silence judged a hang, the timeout "
                "the longest; lower the floor or raise the timeout",
            )
        return self
