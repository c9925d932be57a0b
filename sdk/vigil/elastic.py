"""An elastic job at another size than its spec asks for: the same global batch, the same samples.

A spec defines the global batch at `resources.world_size` ranks of `grad_accum` micro-steps each. An
attempt on `world` ranks (a job that shrank when it lost a node, or grew back) runs
`grad_accum x spec ranks / world` micro-steps on each rank (`vigil.spec.grad_accum_at`, the rule the
scheduler places by), and rank r's micro-step m reads the batch that the spec's rank
`(r x grad_accum + m) // spec_grad_accum` read at its micro-step `... % spec_grad_accum` (`Resize.source`):
the step's samples, so its mean loss and its gradient, are those of the run at the spec's size, up to the
order of the sums. The built-in trainer does this; a program of its own learns it from `run.on_resize`.
Pure: no I/O.
"""

from __future__ import annotations

from dataclasses import dataclass

from vigil.spec import JobSpec, grad_accum_at


@dataclass(frozen=True)
class Resize:
    """How this attempt's ranks cover the spec's global batch."""

    spec_world: int  # the ranks the spec asks for (its global batch is defined there)
    world: int  # the ranks now
    spec_grad_accum: int  # micro-steps per rank at the spec's size
    grad_accum: int  # micro-steps per rank now: the same global batch

    @property
    def resized(self) -> bool:
        """An elastic job at another size (a job that is not elastic keeps its micro-steps at any size)."""
        return self.grad_accum != self.spec_grad_accum

    def source(self, rank: int, micro: int) -> tuple[int, int]:
        """The spec-size (rank, micro-step) whose batch this rank's micro-step `micro` reads."""
        return divmod(rank * self.grad_accum + micro, self.spec_grad_accum)


def resize_of(spec: JobSpec, world: int, grad_accum: int | None = None) -> Resize:
    """The shape of an attempt of `world` ranks of `spec`, whose ranks accumulate `grad_accum` micro-steps
    at the spec's size (default: `spec.train.grad_accum`). A job that is not elastic keeps its micro-steps
    at any size (a rank run by hand). ValueError where the global batch cannot be kept on `world` ranks
    (the scheduler places no such attempt)."""
    accum = spec.train.grad_accum if grad_accum is None else grad_accum
    spec_world = spec.resources.world_size
    if spec.resources.elastic is None or world == spec_world:
        return Resize(spec_world, world, accum, accum)
    return Resize(spec_world, world, accum, grad_accum_at(spec.resources, accum, world))
