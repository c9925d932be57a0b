"""The worker's one hook for Kubernetes rank pods (VIGIL_RANK_RUNTIME=kubernetes): its rank table becomes
a `PodRankTable` (a pod per job per node, `rank_pod`) and its relay a `PodRelay` (TCP on the worker's pod
IP, links admitted by pod IP). The agent drives both as it drives its processes and its Unix socket."""

from __future__ import annotations

from typing import TYPE_CHECKING

from vigil.errors import ConfigError
from vigil_common.bus import Bus
from vigil_common.settings import Settings
from vigil_worker.pod_relay import PodRelay
from vigil_worker.pod_table import PodRankTable, pod_table

if TYPE_CHECKING:
    from vigil_worker.agent import Worker


def install(worker: Worker, settings: Settings, bus: Bus, kind: str) -> PodRankTable | None:
    """Swap the worker's table and relay for the pod ones; None (nothing changed) for the process runtime."""
    table = pod_table(settings, kind, worker.table.state_dir)
    if table is None:
        return None
    if not settings.node_address:
        raise ConfigError("VIGIL_RANK_RUNTIME=kubernetes needs VIGIL_NODE_ADDRESS (the worker pod's IP)")
    worker.table = table
    worker.relay = PodRelay(
        bus, settings.node_name, settings.node_address, settings.relay_port, settings.checkpoint_root, table
    )
    return table
