"""Spec `resources.elastic` (issue 40 §3): the node counts a job may continue on, validated by field, and
the rule that keeps its global batch on fewer nodes (an integer gradient accumulation)."""

from __future__ import annotations

import pytest

from tests.unit.common.test_spec import fields
from vigil.events import LaunchJob, RankPlacement, decode
from vigil.spec import ElasticSpec, JobSpec, Resources, grad_accum_at, parse_spec, shrink_node_counts


def test_elastic_parses_and_max_nodes_defaults_to_the_nodes_asked_for():
    spec = parse_spec("name: t\nresources: {nodes: 4, gpus_per_node: 2, elastic: {min_nodes: 2}}")
    assert spec.resources.elastic == ElasticSpec(min_nodes=2)
    assert (spec.resources.min_nodes, spec.resources.max_nodes) == (2, 4)
    assert spec.resources.world_size == 8  # what the job asks for, and its global batch's size
    plain = parse_spec("name: t\nresources: {nodes: 4}")
    assert plain.resources.elastic is None
    assert (plain.resources.min_nodes, plain.resources.max_nodes) == (4, 4)


@pytest.mark.parametrize(
    ("resources", "field", "says"),
    [
        ("{nodes: 2, elastic: {min_nodes: 0}}", "resources.elastic.min_nodes", "greater than or equal to 1"),
        ("{nodes: 2, elastic: {min_nodes: 3}}", "resources.elastic.min_nodes", "exceeds resources.nodes"),
        ("{nodes: 2, elastic: {min_nodes: 1, max_nodes: 1}}", "resources.elastic.max_nodes", "below"),
        ("{nodes: 2, elastic: {max_nodes: 2}}", "resources.elastic.min_nodes", "required"),
        ("{nodes: 2, elastic: {min_nodes: 1, step: 1}}", "resources.elastic.step", "unknown field"),
        ("{nodes: 2, elastic: {min_nodes: '1'}}", "resources.elastic.min_nodes", "integer"),
        ("{nodes: 2, elastic: true}", "resources.elastic", ""),
    ],
)
def test_a_bad_elastic_range_names_its_field(resources, field, says):
    errors = fields(f"name: t\nresources: {resources}")
    assert field in errors, errors
    assert says in errors[field]


def test_elastic_serialises_only_when_set_and_travels_in_a_launch():
    assert "elastic" not in parse_spec("name: t").model_dump()["resources"]  # LaunchJob v1 as before
    spec = parse_spec("name: t\nresources: {nodes: 2, elastic: {min_nodes: 1}}")
    assert spec.model_dump()["resources"]["elastic"] == {"min_nodes": 1, "max_nodes": None}
    assert JobSpec.model_validate_json(spec.model_dump_json()) == spec
    launch = LaunchJob(
        job_id="j-1",
        attempt=2,
        spec=spec,
        placement=[RankPlacement(rank=0, node="a", device=0, local_rank=0)],  # shrunk: 1 of 2 nodes
        master_addr="10.0.0.1",
        master_port=29500,
    )
    again = decode(launch.to_bytes())
    assert isinstance(again, LaunchJob) and again.spec == spec
    assert (again.world_size, again.spec.resources.world_size) == (1, 2)  # the attempt's, the spec's


@pytest.mark.parametrize(
    ("nodes", "min_nodes", "grad_accum", "counts"),
    [
        (2, 1, 1, (1,)),
        (4, 1, 1, (2, 1)),  # 3 nodes would need 4/3 micro-batches each
        (4, 1, 3, (3, 2, 1)),  # 12 micro-batches divide among 3, 2 or 1 nodes
        (4, 3, 1, ()),  # none at or above min_nodes keeps the batch
        (4, 4, 1, ()),
        (6, 2, 1, (3, 2)),
    ],
)
def test_a_shrink_keeps_an_integer_gradient_accumulation(nodes, min_nodes, grad_accum, counts):
    res = Resources(nodes=nodes, gpus_per_node=2, elastic=ElasticSpec(min_nodes=min_nodes))
    assert shrink_node_counts(res, grad_accum) == counts
    for n in counts:
        assert grad_accum_at(res, grad_accum, n * 2) * n * 2 == grad_accum * res.world_size


def test_a_job_that_is_not_elastic_has_no_smaller_count():
    assert shrink_node_counts(Resources(nodes=4), 4) == ()


def test_grad_accum_at_refuses_a_size_that_breaks_the_batch():
    res = Resources(nodes=4, gpus_per_node=1, elastic=ElasticSpec(min_nodes=1))
    assert grad_accum_at(res, 1, 4) == 1 and grad_accum_at(res, 1, 2) == 2
    with pytest.raises(ValueError, match="not a multiple of 3 ranks"):
        grad_accum_at(res, 1, 3)


def test_an_sdc_faults_error_names_its_field_without_the_kind():
    assert "faults.0.factor" in fields("name: t\nfaults: [{kind: sdc, step: 1, factor: 0.5}]")
