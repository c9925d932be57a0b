"""One rule for a path under a root (`vigil.paths.under`): a checkpoint under the checkpoint root
(`manifest.confine`) and a spec's path under the allowed roots (`confine.within`) are taken or refused
alike. A symlink on the way is refused even where it points back inside: it could be pointed elsewhere
between the check and the open (`within` used to follow it)."""

from __future__ import annotations

from pathlib import Path

import pytest

from vigil.errors import CheckpointError
from vigil.manifest import confine
from vigil.paths import OutsideRoots, within


@pytest.fixture
def tree(tmp_path: Path) -> Path:
    root, outside = tmp_path / "root", tmp_path / "outside"
    (root / "a" / "b").mkdir(parents=True)
    outside.mkdir()
    (root / "a" / "b" / "f.txt").write_text("x")
    (outside / "secret.txt").write_text("s")
    (root / "out").symlink_to(outside)  # leads out
    (root / "in").symlink_to(root / "a")  # leads back inside
    (root / "a" / "f-link.txt").symlink_to(root / "a" / "b" / "f.txt")
    (tmp_path / "root-link").symlink_to(root)  # the root named through a link of its own
    return tmp_path


TAKEN = ["a/b/f.txt", "a/b", ".", "a/new/file", "{root}/a/b/f.txt"]
REFUSED = [
    "out/secret.txt",
    "in/b/f.txt",
    "a/f-link.txt",
    "../outside/secret.txt",
    "a/../a/b/f.txt",
    "{tmp}/outside/secret.txt",
    "/etc/passwd",
    "{tmp}/root-link/a/b/f.txt",  # spelled through a link to the root, not under the root's name
]


def spelled(path: str, tree: Path) -> str:
    return path.format(root=tree / "root", tmp=tree)


@pytest.mark.parametrize("path", TAKEN)
def test_both_take_a_plain_path_under_the_root_as_the_same_real_path(tree: Path, path: str) -> None:
    root = tree / "root"
    got = within(spelled(path, tree), [root])
    assert got == confine(root, spelled(path, tree))
    assert got == root.resolve() / Path(got).relative_to(root.resolve())
    assert not any(p.is_symlink() for p in [got, *got.parents])


@pytest.mark.parametrize("path", REFUSED)
def test_both_refuse_a_way_out_naming_it(tree: Path, path: str) -> None:
    root = tree / "root"
    with pytest.raises(OutsideRoots, match="outside the allowed roots") as spec_error:
        within(spelled(path, tree), [root])
    with pytest.raises(CheckpointError, match="checkpoint root") as checkpoint_error:
        confine(root, spelled(path, tree))
    for error in (spec_error, checkpoint_error):
        message = str(error.value)
        assert "symlink" in message or "'..'" in message or "is outside" in message, message


def test_a_link_back_inside_the_root_is_refused_and_named(tree: Path) -> None:
    with pytest.raises(OutsideRoots, match=r"in/b/f.txt goes through the symlink .*root/in, which counts as"):
        within("in/b/f.txt", [tree / "root"], setting="VIGIL_CODE_ROOTS")


def test_a_root_named_through_a_link_takes_paths_under_either_name(tree: Path) -> None:
    real = (tree / "root" / "a" / "b" / "f.txt").resolve()
    for path in (tree / "root-link" / "a" / "b" / "f.txt", real, "a/b/f.txt"):
        assert within(path, [tree / "root-link"]) == real == confine(tree / "root-link", path)
