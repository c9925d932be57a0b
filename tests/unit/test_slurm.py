"""`vigil slurm`'s pure parts: Slurm's host lists and environment into a worker's settings."""

from __future__ import annotations

import pytest

from vigil.errors import ConfigError
from vigil_cli.slurm import Allocation, expand_hostlist, worker_name, worker_overrides, worker_step_argv
from vigil_common.settings import Settings

ENV = {
    "SLURM_JOB_ID": "4711",
    "SLURM_JOB_NODELIST": "gpu[07-09,12],login1",
    "SLURMD_NODENAME": "gpu08",
    "SLURM_CPUS_ON_NODE": "32",
    "SLURM_GPUS_ON_NODE": "8",
}


@pytest.mark.parametrize(
    ("text", "hosts"),
    [
        ("vm", ["vm"]),
        ("a,b", ["a", "b"]),
        ("gpu[07-09,12],login1", ["gpu07", "gpu08", "gpu09", "gpu12", "login1"]),
        ("n[8-10]", ["n8", "n9", "n10"]),
        ("n[098-100]", ["n098", "n099", "n100"]),
        ("r[1-2]n[1-2]", ["r1n1", "r1n2", "r2n1", "r2n2"]),
        ("node[1-2]-ib", ["node1-ib", "node2-ib"]),
    ],
)
def test_host_lists_expand_as_slurm_writes_them(text: str, hosts: list[str]) -> None:
    assert expand_hostlist(text) == hosts


@pytest.mark.parametrize("text", ["n[1-2", "n1-2]", "n[a-b]"])
def test_a_bad_host_list_names_itself(text: str) -> None:
    with pytest.raises(ConfigError, match="host list"):
        expand_hostlist(text)


def test_the_allocation_comes_from_slurms_variables() -> None:
    alloc = Allocation.from_env(ENV)
    assert alloc == Allocation(
        job_id="4711",
        nodes=["gpu07", "gpu08", "gpu09", "gpu12", "login1"],
        node="gpu08",
        cpus_on_node=32,
        gpus_on_node=8,
    )


def test_outside_an_allocation_the_error_says_so() -> None:
    with pytest.raises(ConfigError, match="SLURM_JOB_ID is not set"):
        Allocation.from_env({})
    with pytest.raises(ConfigError, match="SLURM_CPUS_ON_NODE='x'"):
        Allocation.from_env({**ENV, "SLURM_CPUS_ON_NODE": "x"})
    batch = Allocation.from_env({k: v for k, v in ENV.items() if k != "SLURMD_NODENAME"})
    with pytest.raises(ConfigError, match="SLURMD_NODENAME"):
        worker_overrides(batch, {})


def test_worker_settings_from_the_allocation_are_valid_settings(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("vigil_cli.slurm.node_address", lambda node: f"10.0.0.{node[-1]}")
    overrides = worker_overrides(Allocation.from_env(ENV), ENV)
    assert overrides == {
        "node_name": "gpu08-4711",
        "cpu_slots": 32,
        "node_address": "10.0.0.8",
        "worker_end_ranks_on_stop": True,
    }
    assert Settings.load(**overrides).node_name == "gpu08-4711"


def test_vigil_variables_set_by_the_user_win(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("vigil_cli.slurm.node_address", lambda node: "10.0.0.8")
    env = {**ENV, "VIGIL_NODE_NAME": "mine", "VIGIL_CPU_SLOTS": "4", "VIGIL_NODE_ADDRESS": "10.1.1.1"}
    assert worker_overrides(Allocation.from_env(env), env) == {"worker_end_ranks_on_stop": True}


def test_worker_names_are_subject_tokens() -> None:
    assert worker_name("gpu08.cluster.example", "4711") == "gpu08-4711"
    assert worker_name("n.1", "12_3") == "n-12_3"


def test_one_worker_task_per_node_with_the_nodes_cpus_and_gpus() -> None:
    argv = worker_step_argv(Allocation.from_env(ENV), "/opt/vigil/bin/vigil")
    assert argv[0] == "srun" and argv[-3:] == ["/opt/vigil/bin/vigil", "slurm", "worker"]
    assert {"--nodes=5", "--ntasks-per-node=1", "--cpus-per-task=32", "--gpus-per-task=8"} <= set(argv)
    cpu_only = worker_step_argv(Allocation.from_env({**ENV, "SLURM_GPUS_ON_NODE": ""}), "vigil")
    assert not [a for a in cpu_only if a.startswith("--gpus")]
