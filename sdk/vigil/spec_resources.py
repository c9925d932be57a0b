"""What a job asks of the cluster (`resources:`): nodes, device slots per node, the limits of its ranks
on a node, and whether it may continue on fewer nodes (`elastic`). Re-exported by `vigil.spec`.

An elastic job keeps its global batch when it runs on fewer nodes: each rank accumulates more gradients,
`train.grad_accum x resources.nodes / nodes_now` of them (`grad_accum_at`). So a shrunk attempt's node
count is one that leaves that an integer (`shrink_node_counts`); the scheduler and the ranks read the rule
here.
"""

from __future__ import annotations

from typing import Any

from pydantic import Field, SerializerFunctionWrapHandler, model_serializer, model_validator

from vigil.spec_base import FieldError, StrictModel

MAX_NODES = 4096


class ElasticSpec(StrictModel):
    """The node counts the job may run on: it asks for `resources.nodes`, and where a node is lost and
    neither a spare nor free capacity replaces it, continues on as few as `min_nodes`."""

    min_nodes: int = Field(ge=1, le=MAX_NODES, description="the fewest nodes the job continues on")
    max_nodes: int | None = Field(
        None,
        ge=1,
        le=MAX_NODES,
        description=(
            "validated (at least resources.nodes) but unused: a job running shrunk grows back to"
            " resources.nodes; growing past resources.nodes is not built"
        ),
    )


class Resources(StrictModel):
    nodes: int = Field(1, ge=1, le=MAX_NODES, description="nodes the job spans")
    gpus_per_node: int = Field(
        1, ge=1, le=64, description="device slots per node (CPU slots on a node without GPUs)"
    )
    # What the job's ranks on one node may use together (its cgroup there; see vigil_worker.cgroups).
    max_processes: int = Field(
        4096, ge=16, le=4_194_304, description="processes and threads of the job's ranks on a node at once"
    )
    memory_mb: int | None = Field(
        None, ge=64, le=64 * 1024 * 1024, description="the job's ranks' memory on a node (MiB); unset: none"
    )
    cpus: float | None = Field(
        None, ge=0.01, le=4096, description="CPU time of the job's ranks on a node, in cores; unset: no limit"
    )
    elastic: ElasticSpec | None = Field(
        None,
        description="continue on fewer nodes (down to min_nodes) when a node is lost and nothing replaces "
        "it, keeping the global batch by more gradient accumulation; null: not elastic (the job waits)",
    )

    @property
    def world_size(self) -> int:
        """The ranks the job asks for (and its global batch is defined at)."""
        return self.nodes * self.gpus_per_node

    @property
    def min_nodes(self) -> int:
        return self.elastic.min_nodes if self.elastic else self.nodes

    @property
    def max_nodes(self) -> int:
        if self.elastic is None or self.elastic.max_nodes is None:
            return self.nodes
        return self.elastic.max_nodes

    @model_validator(mode="after")
    def _elastic_range(self) -> Resources:
        if self.elastic is None:
            return self
        if self.elastic.min_nodes > self.nodes:
            raise FieldError(
                "resources.elastic.min_nodes",
                f"resources.elastic.min_nodes ({self.elastic.min_nodes}) exceeds resources.nodes "
                f"({self.nodes}): the job asks for resources.nodes and shrinks down to min_nodes",
            )
        if self.elastic.max_nodes is not None and self.elastic.max_nodes < self.nodes:
            raise FieldError(
                "resources.elastic.max_nodes",
                f"resources.elastic.max_nodes ({self.elastic.max_nodes}) is below resources.nodes "
                f"({self.nodes}); raise it, or leave it out (it defaults to resources.nodes)",
            )
        return self

    @model_serializer(mode="wrap")
    def _limits_when_set(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        """The limits and `elastic` only when they are not the defaults: a spec that sets none serialises
        as it did before they existed (LaunchJob v1's wire format, which older workers, refusing unknown
        fields, keep reading)."""
        data = handler(self)
        for name in ("max_processes", "memory_mb", "cpus", "elastic"):
            if name in data and data[name] == type(self).model_fields[name].default:
                del data[name]
        return data


def shrink_node_counts(resources: Resources, grad_accum: int) -> tuple[int, ...]:
    """The node counts below `resources.nodes` an elastic job may continue on, largest first: from
    `min_nodes` up, those on which `grad_accum_at` is an integer. Empty for a job that is not elastic."""
    if resources.elastic is None:
        return ()
    total = grad_accum * resources.nodes
    return tuple(n for n in range(resources.nodes - 1, resources.min_nodes - 1, -1) if total % n == 0)


def grad_accum_at(resources: Resources, grad_accum: int, world_size: int) -> int:
    """The gradient accumulation that keeps the global batch of `resources.world_size` ranks on
    `world_size` ranks (a shrunk attempt's, `len(LaunchJob.placement)`): `grad_accum x
    resources.world_size / world_size`. ValueError when that is not an integer (the scheduler places no
    attempt on such a size; see `shrink_node_counts`)."""
    whole, rest = divmod(grad_accum * resources.world_size, world_size)
    if rest or whole < 1:
        raise ValueError(
            f"train.grad_accum ({grad_accum}) x {resources.world_size} ranks (resources.nodes x "
            f"resources.gpus_per_node) is not a multiple of {world_size} ranks: the global batch cannot be "
            "kept there"
        )
    return whole
