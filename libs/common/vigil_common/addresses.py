"""Which address a node's ranks are reachable at, when the settings do not say."""

from __future__ import annotations

import socket
from urllib.parse import urlsplit


def source_address(nats_url: str | None) -> str | None:
    """The address this node reaches the NATS server from (the control plane's network, which the other
    nodes share); None without a URL or a route to its host. A UDP socket's connect sends nothing."""
    parts = urlsplit(nats_url or "")
    if not parts.hostname:
        return None
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
            probe.connect((socket.gethostbyname(parts.hostname), parts.port or 4222))
            return str(probe.getsockname()[0])
    except OSError:
        return None


def advertised_address(node_address: str | None, nats_url: str | None) -> str:
    """`VIGIL_NODE_ADDRESS` where set; else the address toward NATS; else loopback (one machine)."""
    return node_address or source_address(nats_url) or "127.0.0.1"
