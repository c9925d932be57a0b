"""A code root's folder as an attempt's writable working folder (`vigil_worker.workdirs`): a copy where no
overlay may be laid (refused past VIGIL_WORKDIR_COPY_MAX_MB, naming it), an overlay where the worker is
root and the kernel has overlayfs; the code root is never written, and an earlier attempt's view goes."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from vigil.errors import SpecError
from vigil_common.settings import Settings
from vigil_worker import workdirs
from vigil_worker.tenancy import JobUser


def settings(tmp_path: Path, **kw: object) -> Settings:
    return Settings(data_dir=tmp_path / "data", node_name="n1", **kw)


def project(tmp_path: Path) -> Path:
    root = tmp_path / "code" / "proj"
    root.mkdir(parents=True)
    (root / "train.py").write_text("print(1)\n")
    (root / "lib").mkdir()
    (root / "lib" / "m.py").write_text("x = 1\n")
    return root


def test_a_copy_takes_the_writes_and_an_earlier_attempts_copy_goes(tmp_path: Path) -> None:
    s, source = settings(tmp_path, workdir_overlay=False), project(tmp_path)
    first = workdirs.make(s, "j1", 1, source, None)
    (first / "written.txt").write_text("mine")
    (first / "train.py").write_text("changed")
    assert not first.is_mount() and (first / "lib" / "m.py").read_text() == "x = 1\n"
    assert (
        sorted(os.listdir(source)) == ["lib", "train.py"]
        and (source / "train.py").read_text() == "print(1)\n"
    )
    second = workdirs.make(s, "j1", 2, source, None)
    assert not first.exists() and not (second / "written.txt").exists()


def test_a_folder_past_the_copy_limit_is_refused_naming_the_setting(tmp_path: Path) -> None:
    s, source = settings(tmp_path, workdir_overlay=False, workdir_copy_max_mb=0.001), project(tmp_path)
    (source / "weights.bin").write_bytes(b"\0" * 4096)
    with pytest.raises(SpecError, match="VIGIL_WORKDIR_COPY_MAX_MB") as refused:
        workdirs.make(s, "j1", 1, source, None)
    assert refused.value.errors[0]["field"] == "entrypoint.workdir"


@pytest.mark.skipif(os.geteuid() != 0, reason="an overlay is mounted by root")
def test_an_overlay_takes_the_writes_and_goes_with_its_attempt(tmp_path: Path) -> None:
    s, source = settings(tmp_path), project(tmp_path)
    view = workdirs.make(s, "j1", 1, source, JobUser(60999))
    try:
        if not view.is_mount():
            pytest.skip("this kernel lays no overlay here (the copy's path is tested above)")
        (view / "written.txt").write_text("mine")
        assert (view / "lib" / "m.py").read_text() == "x = 1\n"
        assert sorted(os.listdir(source)) == ["lib", "train.py"]
        assert {os.stat(view).st_uid, os.stat(view / "lib").st_uid} == {60999}  # the job creates files there
        assert os.stat(source / "lib").st_uid == os.getuid()  # the code root's own folder as it was
    finally:
        workdirs.release(s, "j1", 1)
    assert not view.is_mount()
    workdirs.make(s, "j1", 2, source, None)
    workdirs.release(s, "j1", 2)
    assert not view.exists()
