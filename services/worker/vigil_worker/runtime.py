"""Where a worker's ranks run, chosen once at its start, before the `Worker` is built: its own processes
(a `RankTable`, and a `Relay` on a Unix socket), or Kubernetes pods (VIGIL_RANK_RUNTIME=kubernetes: a
`PodRankTable`, a pod per job per node, and a `PodRelay`, TCP on the worker pod's IP, links admitted by pod
IP). The agent drives either the same way."""

from __future__ import annotations

from dataclasses import dataclass

from vigil.errors import ConfigError
from vigil_common.bus import Bus
from vigil_common.settings import Settings
from vigil_worker.launch import agent_socket
from vigil_worker.pod_relay import PodRelay
from vigil_worker.pod_table import PodRankTable, pod_table
from vigil_worker.procs import RankTable
from vigil_worker.relay import Relay


@dataclass(frozen=True)
class Runtime:
    table: RankTable  # a `PodRankTable` under Kubernetes
    relay: Relay  # a `PodRelay` under Kubernetes
    pods: PodRankTable | None  # its loop of API calls runs beside the worker (None: processes)


def choose_runtime(settings: Settings, bus: Bus, kind: str) -> Runtime:
    """The rank runtime VIGIL_RANK_RUNTIME names, built for this node (its device `kind`)."""
    state_dir = settings.data_dir.resolve() / "worker" / settings.node_name
    pods = pod_table(settings, kind, state_dir)
    if pods is not None:
        if not settings.node_address:
            raise ConfigError("VIGIL_RANK_RUNTIME=kubernetes needs VIGIL_NODE_ADDRESS (the worker pod's IP)")
        relay = PodRelay(
            bus,
            settings.node_name,
            settings.node_address,
            settings.relay_port,
            settings.checkpoint_root,
            pods,
        )
        return Runtime(pods, relay, pods)
    table = RankTable(state_dir)
    relay = Relay(bus, settings.node_name, agent_socket(settings), settings.checkpoint_root, table.find)
    return Runtime(table, relay, None)  # the relay is the ranks' only way to the bus
