#!/usr/bin/env python3
"""Container health checks for Vigil's compose stack, installed in the image as `vigil-healthcheck`.

    vigil-healthcheck http URL       the URL answers 2xx within 3 s (the gateway's /healthz)
    vigil-healthcheck bus COMMAND    a `vigil COMMAND` process runs in this container, and this
                                     container holds an established TCP connection to NATS (the
                                     port of VIGIL_NATS_URL, 4222 when it names none)

Exit status 0: healthy; 1: not, with the reason on stderr. Standard library only (slim images
have no curl), and cheap: it reads /proc and makes at most one local HTTP request.
"""

from __future__ import annotations

import os
import sys
import urllib.error
import urllib.request
from pathlib import Path
from urllib.parse import urlsplit

_ESTABLISHED = "01"  # TCP state code in /proc/net/tcp{,6}


def vigil_running(command: str, proc: Path = Path("/proc")) -> bool:
    """True when some process here runs `vigil ... COMMAND` (its argv has `vigil`, then COMMAND)."""
    for entry in proc.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            args = (entry / "cmdline").read_bytes().decode(errors="replace").split("\0")
        except OSError:  # the process ended while we looked
            continue
        for i, arg in enumerate(args):
            if os.path.basename(arg) == "vigil" and command in args[i + 1 :]:
                return True
    return False


def connected_to_port(port: int, net: Path = Path("/proc/net")) -> bool:
    """True when this network namespace has an established TCP connection to remote `port`."""
    for table in ("tcp", "tcp6"):
        try:
            lines = (net / table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            if len(fields) > 3 and fields[3] == _ESTABLISHED and int(fields[2].rsplit(":", 1)[1], 16) == port:
                return True
    return False


def nats_port(url: str | None) -> int:
    """The port of a NATS URL (`nats://user:pass@host:4222`), 4222 when it names none."""
    return (urlsplit(url).port if url else None) or 4222


def http_ok(url: str, timeout_s: float = 3.0) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as response:
            return 200 <= response.status < 300
    except (urllib.error.URLError, OSError):
        return False


def main(argv: list[str]) -> int:
    if len(argv) != 2 or argv[0] not in ("http", "bus"):
        print("usage: vigil-healthcheck http URL | bus COMMAND", file=sys.stderr)
        return 2
    mode, arg = argv
    if mode == "http":
        if http_ok(arg):
            return 0
        print(f"unhealthy: {arg} did not answer 2xx", file=sys.stderr)
        return 1
    if not vigil_running(arg):
        print(f"unhealthy: no `vigil {arg}` process", file=sys.stderr)
        return 1
    port = nats_port(os.environ.get("VIGIL_NATS_URL"))
    if not connected_to_port(port):
        print(f"unhealthy: `vigil {arg}` holds no connection to NATS (port {port})", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
