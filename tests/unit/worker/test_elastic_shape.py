"""An elastic job's ranks at another size read the spec-size ranks' batches, each exactly once."""

from __future__ import annotations

import pytest

from vigil.errors import SpecError
from vigil.spec import parse_spec
from vigil_trainer.elastic import shape_of


def spec(nodes: int, grad_accum: int, elastic: bool = True):
    resources = {"nodes": nodes, "gpus_per_node": 2}
    if elastic:
        resources["elastic"] = {"min_nodes": 1, "max_nodes": 8}
    return parse_spec({"name": "e", "resources": resources, "train": {"grad_accum": grad_accum}})


@pytest.mark.parametrize(("nodes", "accum", "world"), [(2, 1, 2), (4, 1, 2), (4, 3, 6), (2, 2, 8), (3, 2, 2)])
def test_every_spec_size_batch_is_read_once_at_any_size(nodes, accum, world):
    s = spec(nodes, accum)
    trained, shape = shape_of(s, world)
    assert trained.train.grad_accum * world == accum * s.resources.world_size  # the same global batch
    read = [shape.source(r, m) for r in range(world) for m in range(shape.grad_accum)]
    assert sorted(read) == [(r, m) for r in range(s.resources.world_size) for m in range(accum)]


def test_the_spec_size_reads_its_own_batches_and_keeps_its_spec():
    s = spec(2, 3)
    trained, shape = shape_of(s, 4)
    assert trained is s and not shape.resized
    assert [shape.source(1, m) for m in range(3)] == [(1, 0), (1, 1), (1, 2)]


def test_a_job_that_is_not_elastic_keeps_its_spec_at_any_size():
    s = spec(2, 1, elastic=False)
    trained, shape = shape_of(s, 1)
    assert trained is s and not shape.resized


def test_a_size_that_cannot_keep_the_global_batch_is_refused_by_field():
    with pytest.raises(SpecError, match=r"resources\.elastic"):
        shape_of(spec(3, 1), 4)  # 6 ranks x 1 micro-step on 4 ranks
