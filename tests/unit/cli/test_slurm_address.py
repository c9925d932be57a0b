"""A Slurm worker's advertised address: what its node's name resolves to, unless that is a loopback address
(Debian's /etc/hosts maps a machine's own name to 127.0.1.1): then the address it reaches NATS from."""

from __future__ import annotations

import pytest

from vigil_cli import slurm
from vigil_cli.slurm import Allocation, source_address, worker_overrides

ENV = {
    "SLURM_JOB_ID": "5",
    "SLURM_JOB_NODELIST": "n[1-2]",
    "SLURMD_NODENAME": "n2",
    "SLURM_CPUS_ON_NODE": "1",
}


def test_a_name_that_resolves_to_loopback_gives_the_address_toward_nats(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(slurm, "node_address", lambda node: "127.0.1.1")
    monkeypatch.setattr(slurm, "source_address", lambda url: {"nats://cp:4222": "10.1.0.2"}.get(url or ""))
    env = {**ENV, "VIGIL_NATS_URL": "nats://cp:4222"}
    assert worker_overrides(Allocation.from_env(env), env)["node_address"] == "10.1.0.2"
    # no NATS URL (the worker finds it elsewhere): the resolved address, as before
    assert worker_overrides(Allocation.from_env(ENV), ENV)["node_address"] == "127.0.1.1"


def test_a_name_that_resolves_elsewhere_is_kept(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(slurm, "node_address", lambda node: "10.1.0.7")
    monkeypatch.setattr(slurm, "source_address", lambda url: pytest.fail("not asked"))
    env = {**ENV, "VIGIL_NATS_URL": "nats://cp:4222"}
    assert worker_overrides(Allocation.from_env(env), env)["node_address"] == "10.1.0.7"


def test_the_source_address_is_the_one_routing_to_the_nats_host() -> None:
    assert source_address("nats://127.0.0.1:4222") == "127.0.0.1"
    assert source_address("tls://user:secret@127.0.0.1") == "127.0.0.1"
    assert source_address(None) is None and source_address("") is None
