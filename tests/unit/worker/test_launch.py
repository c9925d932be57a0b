"""How a LaunchJob becomes this node's rank processes: argv, env, run directory."""

from __future__ import annotations

import sys

from vigil_common import events as ev
from vigil_common.settings import Settings
from vigil_common.spec import parse_spec
from vigil_worker.launch import RANK_NATS_TLS_CA_ENV, RANK_NATS_URL_ENV, prepare_ranks


def make_launch() -> ev.LaunchJob:
    spec = parse_spec({"name": "j", "resources": {"nodes": 2, "gpus_per_node": 2}})
    placement = [
        ev.RankPlacement(rank=r, node=node, device=d, local_rank=d)
        for r, (node, d) in enumerate([("a", 0), ("a", 1), ("b", 0), ("b", 1)])
    ]
    return ev.LaunchJob(
        job_id="j1", attempt=2, spec=spec, placement=placement, master_addr="10.0.0.1", master_port=29511
    )


def settings(tmp_path, node: str = "b") -> Settings:
    return Settings(data_dir=tmp_path, node_name=node, nats_url="nats://bus:4222", cpu_slots=2)


def test_only_this_nodes_ranks_with_their_torch_distributed_environment(tmp_path):
    launch = make_launch()
    ranks = prepare_ranks(launch, settings(tmp_path), "gpu")
    assert [r.placement.rank for r in ranks] == [2, 3]
    env = ranks[1].env
    assert (env["RANK"], env["LOCAL_RANK"], env["WORLD_SIZE"], env["LOCAL_WORLD_SIZE"]) == (
        "3",
        "1",
        "4",
        "2",
    )
    assert (env["MASTER_ADDR"], env["MASTER_PORT"], env["CUDA_VISIBLE_DEVICES"]) == ("10.0.0.1", "29511", "1")
    assert env["VIGIL_EXIT_FILE"] == str(ranks[1].exit_path)
    run_dir = tmp_path.resolve() / "runs" / "j1" / "attempt-2"
    assert ranks[1].exit_path == run_dir / "rank-3.exit"
    assert ranks[1].log_path == tmp_path.resolve() / "logs" / "j1" / "attempt-2-rank-3.log"
    assert ev.decode((run_dir / "launch.json").read_bytes(), (ev.LaunchJob,)) == launch


def test_the_rank_command_line_comes_from_vigil_alone(tmp_path):
    (rank, *_) = prepare_ranks(make_launch(), settings(tmp_path), "cpu")
    run_dir = tmp_path.resolve() / "runs" / "j1" / "attempt-2"
    assert rank.argv == [
        sys.executable, "-m", "vigil_worker.trainer",
        "--launch", str(run_dir / "launch.json"),
        "--checkpoint-root", str(tmp_path.resolve() / "checkpoints"),
        "--cache-dir", str(tmp_path.resolve() / "cache"),
        "--node", "b",
        "--data-root", str(tmp_path.resolve()),
    ]  # fmt: skip
    assert rank.env["DS_ACCELERATOR"] == "cpu" and rank.env["CUDA_VISIBLE_DEVICES"] == ""


def test_secrets_reach_a_rank_by_its_environment_never_its_command_line(tmp_path, monkeypatch):
    url = "nats://vigil:s3cret@bus:4222"
    monkeypatch.setenv("VIGIL_DATABASE_URL", "postgresql://vigil:pg-s3cret@db/vigil")
    monkeypatch.setenv("VIGIL_API_TOKEN", "api-token-s3cret-0123456789")
    conf = Settings(data_dir=tmp_path, node_name="b", nats_url=url, data_roots=[tmp_path / "corpus"])
    (rank, *_) = prepare_ranks(make_launch(), conf, "cpu")
    assert not [a for a in rank.argv if "s3cret" in a], rank.argv  # argv is visible to everyone in `ps`
    assert rank.argv[-2:] == ["--data-root", str((tmp_path / "corpus").resolve())]
    assert rank.env[RANK_NATS_URL_ENV] == url
    assert not [k for k, v in rank.env.items() if "s3cret" in v and k != RANK_NATS_URL_ENV]


def test_a_launch_for_other_nodes_writes_nothing(tmp_path):
    assert prepare_ranks(make_launch(), settings(tmp_path, node="c"), "gpu") == []
    assert not (tmp_path / "runs").exists()


def test_the_nats_ca_reaches_a_rank_whatever_way_the_worker_was_given_it(tmp_path, monkeypatch):
    monkeypatch.delenv("VIGIL_NATS_TLS_CA", raising=False)
    conf = Settings(
        data_dir=tmp_path, node_name="b", nats_url="tls://bus:4222", nats_tls_ca=tmp_path / "ca.pem"
    )
    (rank, *_) = prepare_ranks(make_launch(), conf, "cpu")
    assert rank.env[RANK_NATS_TLS_CA_ENV] == str(tmp_path / "ca.pem")
