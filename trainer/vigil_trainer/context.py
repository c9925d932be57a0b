"""The loop's inputs: `RankContext`, built once by `rank.py`, and `TrainState`, where training stands."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from vigil.elastic import Resize
from vigil.run import Run
from vigil.spec import JobSpec
from vigil_trainer.clock import Clock
from vigil_trainer.comm import CommTimer
from vigil_trainer.ds_config import owns_step
from vigil_trainer.faults import FaultInjector
from vigil_trainer.mfu import Peak
from vigil_trainer.observer import NullObserver, Observer
from vigil_trainer.step_judge import StepJudge


@dataclass
class RankContext:
    """Everything the loop needs, built once by `rank.py`."""

    spec: JobSpec
    engine: Any  # deepspeed.DeepSpeedEngine
    tokens: np.ndarray
    zero_stage: int
    precision: str
    device: torch.device
    faults: FaultInjector
    run: Run  # the rank's session with Vigil (the SDK's, as any program's): who it is (`run.identity`),
    # reports, boundary, commands, checkpoints, snapshots, skip windows
    comm: CommTimer = field(default_factory=CommTimer)  # measures nothing until installed
    clock: Clock = field(default_factory=Clock)  # wall clock; CUDA events on GPU
    observer: Observer = field(default_factory=NullObserver)
    flops_per_token: float | None = None  # model FLOPs per token, for MFU
    peak: Peak | None = None  # the device's peak FLOP/s at this precision; None: no MFU
    shape: Resize | None = None  # an elastic job at another size: which of the spec's batches each reads
    judge: StepJudge = field(init=False)  # the spike rule's windows over every rank's losses

    def __post_init__(self) -> None:
        self.judge = StepJudge(self.spec.guardian)

    @property
    def owns_step(self) -> bool:
        """DeepSpeed steps our AdamW directly (no ZeRO, fp32 or bf16 autocast): the trainer computes the
        gradients' norm for the verdict and clips with it (`guard`)."""
        return owns_step(self.zero_stage, self.precision)


@dataclass
class TrainState:
    """Where training stands; a checkpoint's manifest holds the same (step, data position; the skip
    windows are the run's, `run.skip_windows`)."""

    step: int = 0  # the next step to run (= optimizer updates done)
    data_position: int = 0  # the data position that step reads
    saved_step: int | None = None  # the step of the last checkpoint this process saved
    split: int = 1  # each micro-step of the spec runs as this many (2 after an out-of-memory)
    preempted: bool = False  # the emergency checkpoint is written: the rank exits with EXIT_PREEMPTED
