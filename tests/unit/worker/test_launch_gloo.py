"""A rank's gloo listens on the interface of its node's advertised address (GLOO_SOCKET_IFNAME), unless the
job or the worker's environment names one; nothing is set for a loopback address (one-machine clusters)."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from tests.unit.worker.test_launch import SOCKET, make_launch, settings
from vigil_worker import launch as launch_mod
from vigil_worker.launch import interface_of, prepare_ranks


def an_interface_address() -> tuple[str, str] | None:
    """A (non-loopback interface, its IPv4 address) of this machine, from the address it routes from."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect(("192.0.2.1", 9))  # TEST-NET-1: no packet is sent, only a route looked up
        except OSError:
            return None
        address = s.getsockname()[0]
    name = interface_of(address)
    return (name, address) if name else None


def test_addresses_no_interface_holds_name_none() -> None:
    for address in ("127.0.0.1", "127.0.1.1", "0.0.0.0", "::1", "node-a", "203.0.113.77"):
        assert interface_of(address) is None, address


def test_an_interfaces_address_names_it() -> None:
    found = an_interface_address()
    if found is None:
        pytest.skip("no route from a non-loopback interface on this machine")
    name, address = found
    assert name != "lo" and socket.if_nametoindex(name) > 0
    assert interface_of(address) == name


def test_ranks_listen_on_the_interface_of_the_nodes_address(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setattr(launch_mod, "interface_of", lambda address: {"10.0.0.2": "ib0"}.get(address))
    ranks = prepare_ranks(make_launch(), settings(tmp_path, node_address="10.0.0.2"), "cpu", SOCKET)
    assert {r.env["GLOO_SOCKET_IFNAME"] for r in ranks} == {"ib0"}
    # the default address (loopback): gloo left to itself, as before
    ranks = prepare_ranks(make_launch(), settings(tmp_path), "cpu", SOCKET)
    assert all("GLOO_SOCKET_IFNAME" not in r.env for r in ranks)


def test_an_interface_the_job_or_the_worker_names_wins(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setattr(launch_mod, "interface_of", lambda address: "ib0")
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "eth9")  # on VIGIL_RANK_ENV_ALLOW's list
    ranks = prepare_ranks(make_launch(), settings(tmp_path, node_address="10.0.0.2"), "cpu", SOCKET)
    assert {r.env["GLOO_SOCKET_IFNAME"] for r in ranks} == {"eth9"}
