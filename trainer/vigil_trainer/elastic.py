"""The built-in trainer's spec at another size than the spec's (an elastic job that shrank or grew back):
the accumulation that keeps the global batch (`vigil.elastic`: which batch each micro-step reads)."""

from __future__ import annotations

from vigil.elastic import Resize, resize_of
from vigil.errors import SpecError
from vigil.spec import JobSpec


def shape_of(spec: JobSpec, world: int) -> tuple[JobSpec, Resize]:
    """The spec this attempt's ranks train by (an elastic job at another size: its `train.grad_accum`
    keeps the global batch), and the attempt's shape."""
    try:
        shape = resize_of(spec, world)
    except ValueError as exc:
        raise SpecError([{"field": "resources.elastic", "message": str(exc)}]) from exc
    if not shape.resized:
        return spec, shape
    train = spec.train.model_copy(update={"grad_accum": shape.grad_accum})
    return spec.model_copy(update={"train": train}), shape
