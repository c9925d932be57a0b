"""How a LaunchJob becomes this node's rank processes: argv, env, cwd, run directory."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from vigil import events as ev
from vigil import protocol as proto
from vigil.errors import SpecError
from vigil.run import spec_from_env
from vigil.spec import parse_spec
from vigil_common.settings import Settings
from vigil_worker.launch import inherited, prepare_ranks
from vigil_worker.tenancy import JobUser, Tenancy

SOCKET = Path("/run/vigil/agent.sock")


def make_launch(**spec: object) -> ev.LaunchJob:
    spec = parse_spec({"name": "j", "resources": {"nodes": 2, "gpus_per_node": 2}, **spec})
    placement = [
        ev.RankPlacement(rank=r, node=node, device=d, local_rank=d)
        for r, (node, d) in enumerate([("a", 0), ("a", 1), ("b", 0), ("b", 1)])
    ]
    return ev.LaunchJob(
        job_id="j1",
        attempt=2,
        spec=spec,
        placement=placement,
        master_addr="10.0.0.1",
        master_port=29511,
        resume_from="/ckpt/j1/step_00000040",
        skip_data=(40, 42),
    )


USER = JobUser(60123)


def settings(tmp_path: Path, node: str = "b", **kw: object) -> Settings:
    return Settings(
        **{"data_dir": tmp_path, "node_name": node, "nats_url": "nats://bus:4222", "cpu_slots": 2, **kw}
    )


def test_only_this_nodes_ranks_with_torchruns_environment_and_the_sdks(tmp_path):
    launch = make_launch()
    ranks = prepare_ranks(launch, settings(tmp_path), "gpu", SOCKET)
    assert [r.placement.rank for r in ranks] == [2, 3]
    env = ranks[1].env
    assert (env["RANK"], env["LOCAL_RANK"], env["WORLD_SIZE"], env["LOCAL_WORLD_SIZE"], env["NODE_RANK"]) == (
        "3", "1", "4", "2", "1",
    )  # fmt: skip
    assert (env["MASTER_ADDR"], env["MASTER_PORT"], env["CUDA_VISIBLE_DEVICES"]) == ("10.0.0.1", "29511", "1")
    assert env[proto.EXIT_FILE_ENV] == str(ranks[1].exit_path)
    assert (env[proto.JOB_ID_ENV], env[proto.ATTEMPT_ENV], env[proto.NODE_ENV]) == ("j1", "2", "b")
    assert env[proto.AGENT_SOCKET_ENV] == str(SOCKET)
    assert env[proto.RESUME_FROM_ENV] == "/ckpt/j1/step_00000040" and env[proto.SKIP_DATA_ENV] == "40:42"
    assert (
        env[proto.SNAPSHOT_DIR_ENV] == "/dev/shm/vigil-b/j1"
    )  # in-memory snapshots: this node's, this job's
    assert ranks[0].token != ranks[1].token and len(ranks[1].token) >= 32
    assert not [k for k, v in env.items() if ranks[1].token in v], "the token reaches a rank on a pipe"
    run_dir = tmp_path.resolve() / "runs" / "j1" / "attempt-2"
    assert ranks[1].exit_path == run_dir / "rank-3.exit"
    assert ranks[1].log_path == tmp_path.resolve() / "logs" / "j1" / "attempt-2-rank-3.log"
    assert ev.decode((run_dir / "launch.json").read_bytes(), (ev.LaunchJob,)) == launch


def test_the_built_in_trainers_command_line_comes_from_vigil_alone(tmp_path):
    (rank, *_) = prepare_ranks(make_launch(), settings(tmp_path), "cpu", SOCKET)
    run_dir = tmp_path.resolve() / "runs" / "j1" / "attempt-2"
    assert rank.argv[:3] == [sys.executable, "-m", "vigil_trainer"]
    assert rank.argv[3:11] == [
        "--launch", str(run_dir / "launch.json"),
        "--checkpoint-root", str(tmp_path.resolve() / "checkpoints"),
        "--cache-dir", str(tmp_path.resolve() / "cache"),
        "--node", "b",
    ]  # fmt: skip
    assert rank.cwd is None
    assert rank.env["DS_ACCELERATOR"] == "cpu" and rank.env["CUDA_VISIBLE_DEVICES"] == ""
    assert "--peak-tflops" not in rank.argv  # unset: the trainer's table, or its measured rate


def test_the_workers_peak_reaches_the_trainer_as_an_argument_and_its_mfu_uses_it(tmp_path):
    """The trainer reads no control-plane setting: VIGIL_PEAK_TFLOPS, the worker's, comes in its argv."""
    import torch

    from vigil_trainer.rank import device_peak, parse_args

    (rank, *_) = prepare_ranks(make_launch(), settings(tmp_path, peak_tflops=312.5), "cpu", SOCKET)
    assert rank.argv[-2:] == ["--peak-tflops", "312.5"]
    args = parse_args(rank.argv[3:])
    peak = device_peak(torch.device("cpu"), "bf16", args.peak_tflops)
    assert peak is not None and (peak.flops, peak.source) == (312.5e12, "VIGIL_PEAK_TFLOPS")


def test_a_rank_inherits_no_secret_and_nothing_outside_the_allowlist(tmp_path, monkeypatch):
    monkeypatch.setenv("VIGIL_DATABASE_URL", "postgresql://vigil:pg-s3cret@db/vigil")
    monkeypatch.setenv("VIGIL_API_TOKEN", "api-token-s3cret-0123456789")
    monkeypatch.setenv("VIGIL_NATS_URL", "nats://worker-b:s3cret@bus:4222")
    monkeypatch.setenv("NATS_WORKER_PASSWORD", "s3cret")  # what Kubernetes gives a worker pod
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "s3cret")
    monkeypatch.setenv("NCCL_DEBUG", "INFO")
    conf = settings(tmp_path, nats_url="nats://worker-b:s3cret@bus:4222")
    (rank, *_) = prepare_ranks(make_launch(), conf, "cpu", SOCKET)
    assert not [a for a in rank.argv if "s3cret" in a], rank.argv  # argv is visible to everyone in `ps`
    assert not [k for k, v in rank.env.items() if "s3cret" in v], "a rank holds no credential"
    assert rank.env["NCCL_DEBUG"] == "INFO" and rank.env["PATH"]
    assert "NATS_WORKER_PASSWORD" not in rank.env and "VIGIL_NATS_URL" not in rank.env


def test_the_allowlist_takes_names_and_prefixes():
    allow = Settings(rank_env_allow=["PATH", "NCCL_*"])
    got = inherited(allow, {"PATH": "/bin", "NCCL_IB_HCA": "mlx5", "NCCLX": "no", "HOME": "/root"})
    assert got == {"PATH": "/bin", "NCCL_IB_HCA": "mlx5"}


def test_a_jobs_own_program_runs_in_its_workdir_under_a_code_root(tmp_path):
    code = tmp_path / "code"
    (code / "proj").mkdir(parents=True)
    launch = make_launch(
        entrypoint={
            "argv": ["python", "train.py", "--lr", "3e-4"],
            "workdir": "proj",
            "env": {"MY_FLAG": "1"},
        }
    )
    (rank, *_) = prepare_ranks(launch, settings(tmp_path, code_roots=[code]), "cpu", SOCKET, USER)
    assert rank.argv == [sys.executable, "train.py", "--lr", "3e-4"]  # `python`: the worker's own
    assert rank.cwd == (code / "proj").resolve()
    assert rank.env["MY_FLAG"] == "1"
    home = tmp_path.resolve() / "runs" / "j1" / "home"  # the job's own, not the worker's
    assert (rank.env["HOME"], rank.env["USER"], rank.env["LOGNAME"]) == (str(home), USER.name, USER.name)
    # its temporary files too: not the node's /tmp, where the uid's next job would find them
    assert rank.env["TMPDIR"] == str(home.parent / "tmp") and home.parent.name == "j1"


def test_a_rank_reads_its_jobs_spec_from_the_environment(tmp_path):
    """`vigil.Run.spec`: the spec as submitted, but for entrypoint.env (the environment itself)."""
    code = tmp_path / "code"
    code.mkdir()
    launch = make_launch(
        entrypoint={"argv": ["python", "t.py", "x" * 4000], "env": {"MY_FLAG": "1"}},
        train={"steps": 1234},
        checkpoint={"every": 50, "keep": 2},
    )
    (rank, *_) = prepare_ranks(launch, settings(tmp_path, code_roots=[code]), "cpu", SOCKET, USER)
    spec = spec_from_env(rank.env)
    assert spec is not None and (spec.train.steps, spec.checkpoint.every) == (1234, 50)
    assert launch.spec.entrypoint is not None and spec.entrypoint is not None
    assert spec.entrypoint.env == {} and rank.env["MY_FLAG"] == "1"
    assert spec.model_copy(update={"entrypoint": launch.spec.entrypoint}) == launch.spec


def test_a_worker_that_cannot_switch_users_runs_a_jobs_program_only_with_shared_trust(tmp_path):
    code = tmp_path / "code"
    code.mkdir()
    launch = make_launch(entrypoint={"argv": ["python", "x.py"]})
    with pytest.raises(SpecError) as err:
        prepare_ranks(launch, settings(tmp_path, code_roots=[code]), "cpu", SOCKET, None)
    assert err.value.errors[0]["field"] == "entrypoint"
    assert "VIGIL_SHARED_TRUST" in err.value.errors[0]["message"]
    shared = settings(tmp_path, code_roots=[code], shared_trust=True)
    (rank, *_) = prepare_ranks(launch, shared, "cpu", SOCKET, None)
    assert rank.argv == [sys.executable, "x.py"]
    # the built-in trainer runs either way
    assert prepare_ranks(make_launch(), settings(tmp_path), "cpu", SOCKET, None)


def test_a_rank_pod_is_its_jobs_own_user_so_its_program_needs_no_shared_trust(tmp_path):
    code = tmp_path / "code"
    code.mkdir()
    pods = settings(tmp_path, code_roots=[code], rank_runtime="kubernetes", rank_image="vigil-worker:dev")
    tenancy = Tenancy(pods)  # whether or not this test runs as root: the worker switches no user for a pod
    launch = make_launch(entrypoint={"argv": ["python", "x.py"]})
    assert not tenancy.isolated and tenancy.user_for("j1") is None and tenancy.cgroup(launch) is None
    (rank, *_) = prepare_ranks(launch, pods, "cpu", SOCKET, None)
    assert rank.argv == [sys.executable, "x.py"] and not pods.shared_trust


@pytest.mark.parametrize("workdir", ["/etc", "../..", "link"])
def test_a_workdir_outside_the_code_roots_is_refused_naming_the_field(tmp_path, workdir):
    code = tmp_path / "code"
    code.mkdir()
    (code / "link").symlink_to("/etc")
    launch = make_launch(entrypoint={"argv": ["python", "x.py"], "workdir": workdir})
    with pytest.raises(SpecError) as err:
        prepare_ranks(launch, settings(tmp_path, code_roots=[code]), "cpu", SOCKET, USER)
    [error] = err.value.errors
    assert error["field"] == "entrypoint.workdir"
    assert error["message"].endswith("see VIGIL_CODE_ROOTS") and "VIGIL_DATA_ROOTS" not in error["message"]


def test_entrypoints_can_be_turned_off(tmp_path):
    launch = make_launch(entrypoint={"argv": ["python", "x.py"]})
    with pytest.raises(SpecError) as err:
        prepare_ranks(launch, settings(tmp_path, entrypoints=False), "cpu", SOCKET)
    assert err.value.errors[0]["field"] == "entrypoint"


def test_a_launch_for_other_nodes_writes_nothing(tmp_path):
    assert prepare_ranks(make_launch(), settings(tmp_path, node="c"), "gpu", SOCKET) == []
    assert not (tmp_path / "runs").exists()


def test_a_job_run_as_the_workers_own_user_has_its_snapshot_folder_too(tmp_path, monkeypatch):
    """No uid pool (the worker not root, as in the compose image; here VIGIL_JOB_UIDS=off): the worker makes
    the folder the ranks are handed (VIGIL_SNAPSHOT_DIR), its own. The compose test's ranks failed at their
    first snapshot without it."""
    from vigil_worker import tenancy

    monkeypatch.setattr(tenancy, "SHM", tmp_path / "shm")
    (tmp_path / "shm").mkdir()
    mine = Tenancy(settings(tmp_path, job_uids="off"))
    assert not mine.isolated
    folder = tenancy.snapshot_dir(mine.settings, "j1")
    assert folder is not None and not folder.exists()
    mine.own_snapshots("j1")
    mine.own_snapshots("j1")  # a relaunch: already there
    assert folder.is_dir() and folder.stat().st_uid == os.geteuid()


def test_a_jobs_snapshot_folder_is_its_users_under_the_workers_own_folder_on_shm(tmp_path, monkeypatch):
    import os
    import stat

    from vigil_worker import tenancy

    monkeypatch.setattr(tenancy, "SHM", tmp_path / "shm")
    (tmp_path / "shm").mkdir()
    s = settings(tmp_path)
    assert tenancy.snapshot_dir(s, "j1") == tmp_path / "shm" / "vigil-b" / "j1"
    assert tenancy._node_shm(tmp_path / "shm" / "vigil-b")
    assert stat.S_IMODE((tmp_path / "shm" / "vigil-b").stat().st_mode) == 0o711
    for job in ("j1", "j2"):
        (tmp_path / "shm" / "vigil-b" / job / "rank_0").mkdir(parents=True)
    assert Tenancy(s).sweep_snapshots({"j2"}) == ["j1"]  # at the worker's start: j1 has no rank here
    assert sorted(p.name for p in (tmp_path / "shm" / "vigil-b").iterdir()) == ["j2"]
    Tenancy(s).close()  # the worker stops with no rank left: no job's snapshots, no node folder stay
    assert not (tmp_path / "shm" / "vigil-b").exists()
    if os.geteuid() == 0:  # a node folder someone else made first is not the worker's
        theirs = tmp_path / "shm" / "vigil-c"
        theirs.mkdir()
        os.chown(theirs, USER.uid, USER.gid)
        assert not tenancy._node_shm(theirs)
