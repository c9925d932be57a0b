"""An elastic job's ranks at another size than its spec's: the same global batch, the same samples.

The spec defines the global batch at `resources.world_size` ranks of `train.grad_accum` micro-steps each.
An attempt on `world` ranks (a job that shrank, or grew back) runs `grad_accum_at` micro-steps on each
rank (`vigil.spec.grad_accum_at`: the rule the scheduler places by), and rank r's micro-step m reads the
batch that the spec's rank `(r * grad_accum + m) // spec_grad_accum` read at its micro-step
`(...) % spec_grad_accum`: the step's samples, and so its mean loss and gradient, are the spec-size run's,
up to the order of the reduction. Pure: unit tested without DeepSpeed.
"""

from __future__ import annotations

from dataclasses import dataclass

from vigil.errors import SpecError
from vigil.spec import JobSpec, grad_accum_at


@dataclass(frozen=True)
class Shape:
    """How this attempt's ranks cover the spec's global batch."""

    world: int  # ranks now
    grad_accum: int  # micro-steps per rank now
    spec_grad_accum: int  # micro-steps per rank at the spec's size

    @property
    def resized(self) -> bool:
        return self.grad_accum != self.spec_grad_accum

    def source(self, rank: int, micro: int) -> tuple[int, int]:
        """The spec-size (rank, micro-step) whose batch this rank's micro-step reads."""
        return divmod(rank * self.grad_accum + micro, self.spec_grad_accum)


def shape_of(spec: JobSpec, world: int) -> tuple[JobSpec, Shape]:
    """The spec this attempt's ranks train by (an elastic job at another size: `train.grad_accum` that
    keeps the global batch) and its shape. A job that is not elastic keeps its spec as it is, whatever its
    size (a rank run by hand)."""
    accum = spec.train.grad_accum
    if spec.resources.elastic is None or world == spec.resources.world_size:
        return spec, Shape(world, accum, accum)
    try:
        now = grad_accum_at(spec.resources, accum, world)
    except ValueError as exc:
        raise SpecError([{"field": "resources.elastic", "message": str(exc)}]) from exc
    train = spec.train.model_copy(update={"grad_accum": now})
    return spec.model_copy(update={"train": train}), Shape(world, now, accum)
