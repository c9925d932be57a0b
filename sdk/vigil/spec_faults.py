"""Injected faults (`faults:`), for tests and demos: what the built-in trainer does wrong, and when.
Re-exported by `vigil.spec`."""

from __future__ import annotations

from typing import Annotated, Literal, get_args

from pydantic import Field

from vigil.spec_base import StrictModel


class _Fault(StrictModel):
    step: int = Field(ge=0, le=10_000_000, description="the step at which the fault fires")
    rank: int = Field(0, ge=0, le=4096 * 64)
    repeat: bool = Field(False, description="fire every time the step is reached, not only once per job")


class _DataFault(_Fault):
    """A fault in the data: it fires whenever `step` reads its data position again (a replay
    reproduces it; skipping the data window cures it)."""

    data_position: int | None = Field(
        None,
        ge=0,
        le=10_000_000_000,
        description="its data position; null: the one `step` first reads",
    )


class NanFault(_DataFault):
    kind: Literal["nan"]


class SpikeFault(_DataFault):
    kind: Literal["spike"]
    factor: float = Field(50.0, gt=1.0, le=1e6, description="the loss is multiplied by this")


class SdcFault(_Fault):
    """Silent data corruption: one rank's result of `step` is corrupted on its first execution only, as a
    flipped bit in a GPU would (a replay of the step is clean)."""

    kind: Literal["sdc"]
    factor: float | None = Field(
        None, gt=1.0, le=1e6, description="the loss (and so the gradient) is multiplied by this; null: NaN"
    )


class SlowRankFault(_Fault):
    kind: Literal["slow_rank"]
    delay_s: float = Field(0.2, gt=0, le=600, description="extra delay per step from `step` on")


class CrashFault(_Fault):
    kind: Literal["crash"]
    exit_code: int = Field(3, ge=1, le=255)


class HangFault(_Fault):
    kind: Literal["hang"]


class OomFault(_Fault):
    """The step's first forward raises torch.OutOfMemoryError, as a CUDA OOM would."""

    kind: Literal["oom"]


Fault = Annotated[
    NanFault | SpikeFault | SdcFault | SlowRankFault | CrashFault | HangFault | OomFault,
    Field(discriminator="kind"),
]

# The kinds, as `describe_errors` leaves them out of a field's path (`faults.0.rank`, not
# `faults.0.crash.rank`).
FAULT_KINDS: frozenset[str] = frozenset(
    get_args(kind.model_fields["kind"].annotation)[0] for kind in get_args(get_args(Fault)[0])
)
