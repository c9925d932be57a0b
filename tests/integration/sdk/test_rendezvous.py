"""Rank 0's TCPStore listens on the rendezvous address only (torch's own env:// listens everywhere)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from vigil_common.embedded import free_port

pytestmark = [pytest.mark.integration, pytest.mark.security]

PROGRAM = textwrap.dedent(
    """
    import os, sys
    import torch.distributed as dist
    port = int(os.environ["MASTER_PORT"])
    if sys.argv[1] == "vigil":
        import vigil
        vigil.init_process_group("gloo")
    else:
        dist.init_process_group("gloo", init_method="env://")
    listening = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in open(table).read().splitlines()[1:]:
            local, state = line.split()[1], line.split()[3]
            address, hexport = local.rsplit(":", 1)
            if state == "0A" and int(hexport, 16) == port:
                listening.add(address)
    print(sorted(listening))
    dist.destroy_process_group()
    """
)


def listening_addresses(how: str) -> list[str]:
    env = {
        **os.environ,
        "RANK": "0",
        "WORLD_SIZE": "1",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(free_port()),
    }
    done = subprocess.run(
        [sys.executable, "-c", PROGRAM, how], env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    return eval(done.stdout.strip().splitlines()[-1])  # a printed list of hex addresses


def test_the_store_listens_on_master_addr_only():
    assert listening_addresses("vigil") == ["0100007F"]  # 127.0.0.1, little-endian hex


def test_torchs_own_rendezvous_listens_on_every_interface():
    """Why Vigil makes the store itself: the finding this guards against."""
    assert set(listening_addresses("torch")) & {"00000000", "00000000000000000000000000000000"}
