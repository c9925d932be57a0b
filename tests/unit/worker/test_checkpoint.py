import json
import os

import pytest
import torch

from vigil.errors import CheckpointError
from vigil_trainer import checkpoint as ckpt


def make(root, job="j1", step=0, files=None):
    path = ckpt.step_dir(root, job, step)
    (path / "ds").mkdir(parents=True)
    for name, data in (files or {"ds/model.pt": b"weights", "ds/optim.pt": b"moments"}).items():
        (path / name).write_bytes(data)
    return ckpt.write_manifest(path, job_id=job, step=step, data_position=step + 3, skip_windows=[(1, 2)])


def test_manifest_lists_every_file_and_verifies(tmp_path):
    m = make(tmp_path, step=20)
    assert set(m.files) == {"ds/model.pt", "ds/optim.pt"}
    body = json.loads((m.path / ckpt.MANIFEST).read_text())
    assert body["step"] == 20 and body["data_position"] == 23 and body["skip_windows"] == [[1, 2]]
    v = ckpt.verify(m.path, root=tmp_path)
    assert (v.step, v.data_position, v.skip_windows, v.sha256) == (20, 23, [(1, 2)], m.sha256)
    assert v.bytes == len(b"weights") + len(b"moments")
    assert not list(m.path.glob("*.tmp"))  # the manifest appeared by rename


@pytest.mark.parametrize(
    ("damage", "message"),
    [
        (lambda p: (p / "ds/model.pt").write_bytes(b"weightz"), "SHA-256"),
        (lambda p: (p / "ds/model.pt").write_bytes(b"w"), "bytes"),
        (lambda p: (p / "ds/optim.pt").unlink(), "missing"),
        (lambda p: (p / "ds/extra.pt").write_bytes(b"x"), "not in the manifest"),
        (lambda p: (p / ckpt.MANIFEST).unlink(), "no manifest"),
        (lambda p: (p / ckpt.MANIFEST).write_text("{"), "unreadable"),
    ],
)
def test_a_damaged_checkpoint_is_refused(tmp_path, damage, message):
    m = make(tmp_path)
    damage(m.path)
    with pytest.raises(CheckpointError, match=message):
        ckpt.verify(m.path, root=tmp_path)


def test_manifest_entries_cannot_escape(tmp_path):
    m = make(tmp_path)
    body = json.loads((m.path / ckpt.MANIFEST).read_text())
    body["files"]["../../etc/passwd"] = {"bytes": 1, "sha256": "0"}
    (m.path / ckpt.MANIFEST).write_text(json.dumps(body))
    with pytest.raises(CheckpointError, match="escapes"):
        ckpt.verify(m.path, root=tmp_path)


def test_paths_are_confined_under_the_root(tmp_path):
    root = tmp_path / "root"
    m = make(root)
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    with pytest.raises(CheckpointError, match=r"'\.\.'"):
        ckpt.confine(root, root / "j1" / ".." / "j1" / "step_00000000")
    with pytest.raises(CheckpointError, match="outside"):
        ckpt.verify(outside, root=root)
    os.symlink(outside, root / "j1" / "step_00000099")
    with pytest.raises(CheckpointError, match="symlink"):
        ckpt.verify(root / "j1" / "step_00000099", root=root)
    os.symlink(m.path / "ds" / "model.pt", m.path / "ds" / "link.pt")
    with pytest.raises(CheckpointError, match="symlink"):
        ckpt.verify(m.path, root=root)
    assert ckpt.confine(root, "j1/step_00000000") == m.path  # relative to the root


def test_newest_valid_skips_corrupt_and_later_ones(tmp_path):
    for s in (0, 10, 20, 30):
        make(tmp_path, step=s)
    (ckpt.step_dir(tmp_path, "j1", 20) / "ds" / "model.pt").write_bytes(b"bitrot!")
    assert ckpt.newest_valid(tmp_path, "j1").step == 30
    assert ckpt.newest_valid(tmp_path, "j1", at_or_before=25).step == 10
    assert ckpt.newest_valid(tmp_path, "nojob") is None


def test_keep_last_k(tmp_path):
    for s in (0, 10, 20, 30):
        make(tmp_path, step=s)
    ckpt.step_dir(tmp_path, "j1", 5).mkdir()  # an incomplete one, older than those kept
    removed = ckpt.retain(tmp_path, "j1", keep=2)
    assert sorted(p.name for p in removed) == ["step_00000000", "step_00000005", "step_00000010"]
    assert [s for s, _ in ckpt.checkpoints(tmp_path, "j1")] == [20, 30]


def test_step_of_reads_only_step_directory_names(tmp_path):
    assert ckpt.step_of(ckpt.step_dir(tmp_path, "j1", 40)) == 40
    assert ckpt.step_of("/anywhere/step_00000007") == 7
    for other in ("/x/step_", "/x/step_abc", "/x/latest", "/x/step_1/ds", "/x/step_-1"):
        assert ckpt.step_of(other) is None, other


def test_listing_ignores_links_and_other_names(tmp_path):
    for s in (10, 20):
        make(tmp_path, step=s)
    job = tmp_path / "j1"
    (job / "step_00000005").symlink_to(job / "step_00000020")
    (job / "notes").mkdir()
    (job / "step_00000003").write_text("a file, not a checkpoint")
    assert [s for s, _ in ckpt.checkpoints(tmp_path, "j1")] == [10, 20]
    assert [p.name for p in ckpt.retain(tmp_path, "j1", keep=1)] == ["step_00000010"]
    assert (job / "step_00000005").is_symlink() and (job / "step_00000003").is_file()


def test_safe_load_refuses_pickled_code(tmp_path):
    good = tmp_path / "good.pt"
    torch.save({"w": torch.ones(2)}, good)
    assert torch.equal(ckpt.safe_load(good)["w"], torch.ones(2))
    evil = tmp_path / "evil.pt"
    torch.save({"f": os.system}, evil)
    with pytest.raises(Exception, match=r"weights_only|Unsupported global"):
        ckpt.safe_load(evil)


# --- malformed manifests: INVALID with the reason, never a traceback -----------------------------------

_DEEP = "[" * 100_000 + "]" * 100_000


@pytest.mark.parametrize(
    ("edit", "says"),
    [
        (
            lambda b: b | {"files": {"ds/model.pt": {"bytes": "7", "sha256": "0" * 64}}},
            "files.ds/model.pt.bytes",
        ),
        (lambda b: b | {"files": [["ds/model.pt", 7]]}, "files"),
        (lambda b: {k: v for k, v in b.items() if k != "step"}, "step"),
        (lambda b: {k: v for k, v in b.items() if k != "files"}, "files"),
        (lambda b: b | {"step": 10**400}, "step"),
        (lambda b: b | {"step": 1e308}, "step"),
        (lambda b: b | {"data_position": True}, "data_position"),
        (lambda b: b | {"skip_windows": [[1, 2, 3]]}, "skip_windows"),
        (lambda b: b | {"files": {"a\x00b": {"bytes": 1, "sha256": "0" * 64}}}, "escapes"),
        (lambda b: b | {"format": "other"}, "format"),
        (lambda b: [b], "manifest"),
        (lambda b: _DEEP, "manifest"),
    ],
)
def test_a_malformed_manifest_is_invalid_with_its_reason(tmp_path, edit, says):
    from click.testing import CliRunner

    from vigil_cli.main import cli

    m = make(tmp_path)
    body = edit(json.loads((m.path / ckpt.MANIFEST).read_text()))
    text = body if isinstance(body, str) else json.dumps(body).replace("1e+308", "1e308")
    (m.path / ckpt.MANIFEST).write_text(text)
    with pytest.raises(CheckpointError, match=r"manifest|escapes"):
        ckpt.verify(m.path, root=tmp_path)
    result = CliRunner().invoke(cli, ["checkpoint", "verify", str(m.path)])
    assert result.exit_code == 1, result.output
    assert result.output.startswith("INVALID ") and says in result.output, result.output
    assert "Traceback" not in result.output
    assert result.exception is None or isinstance(result.exception, SystemExit)


def test_a_rollback_naming_another_jobs_checkpoint_loads_this_jobs_own(tmp_path):
    """A command naming `checkpoints/<other job>/step_...` is refused; the job falls back to its own."""
    import torch.distributed as dist

    from vigil.link import NullLink
    from vigil.run import Identity, Run

    def run(job: str) -> Run:
        return Run(Identity(job, 1, 0, 1, 0, "n"), NullLink(), checkpoint_root=tmp_path)

    mine, other = make(tmp_path, job="mine", step=4), make(tmp_path, job="other", step=8)
    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        chosen = run("mine").choose_checkpoint(str(other.path), 9)
        assert chosen.path == mine.path and chosen.job_id == "mine"
        with pytest.raises(CheckpointError, match="no valid checkpoint"):
            run("fresh").choose_checkpoint(str(other.path), None)
    finally:
        dist.destroy_process_group()
