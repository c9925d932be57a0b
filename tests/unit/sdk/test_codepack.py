"""Code packages (`vigil.codepack`): what a folder packs to (ignore rules, links, modes), the same files give
the same hash, the size limit names the largest files, and a pack with a link out of itself, a device file,
an absolute path, a `..` or a hard link is refused naming the entry; a pack is unpacked only under its own
hash."""

from __future__ import annotations

import gzip
import io
import os
import tarfile
from pathlib import Path

import pytest

from vigil.codepack import MIB, PackRefused, check, digest, max_mb_from, pack, unpack, walk


def tree(root: Path, files: dict[str, str | bytes]) -> Path:
    for name, content in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(content.encode() if isinstance(content, str) else content)
    return root


def names(root: Path) -> list[str]:
    return [name for name, kind, _ in walk(root) if kind != "dir"]


def test_gitignore_and_vigilignore_rules_from_the_top_folder_down(tmp_path: Path) -> None:
    tree(
        tmp_path,
        {
            "train.py": "print(1)",
            ".gitignore": "*.log\ndata/\n!keep.log\n",
            ".vigilignore": "secrets.txt\n!data/\n",  # the second file overrides the first
            "run.log": "x",
            "keep.log": "x",
            "secrets.txt": "x",
            "data/small.csv": "1,2",
            "sub/.gitignore": "*.tmp\n!run.log\n",  # a deeper file over a shallower one
            "sub/a.tmp": "x",
            "sub/run.log": "x",
            "sub/b.py": "x",
            "out/.gitignore": "*\n",
            "out/model.bin": "x",
            ".git/config": "x",
            "__pycache__/x.pyc": "x",
        },
    )
    (tmp_path / ".vigilignore").write_text("secrets.txt\n!data/\n__pycache__/\n")
    assert sorted(names(tmp_path)) == [
        ".gitignore",
        ".vigilignore",
        "data/small.csv",
        "keep.log",
        "sub/.gitignore",
        "sub/b.py",
        "sub/run.log",
        "train.py",
    ]


def test_the_same_files_give_the_same_hash_and_a_change_another(tmp_path: Path) -> None:
    tree(tmp_path, {"a.py": "1", "b/c.py": "2"})
    os.chmod(tmp_path / "a.py", 0o755)
    first = pack(tmp_path)
    os.utime(tmp_path / "a.py", (1, 1))  # the time is not packed
    assert pack(tmp_path).sha256 == first.sha256 == digest(first.data)
    (tmp_path / "b/c.py").write_text("3")
    assert pack(tmp_path).sha256 != first.sha256
    out = tmp_path.parent / "out"
    unpack(first.data, first.sha256, out)
    assert (out / "b/c.py").read_text() == "2" and os.stat(out / "a.py").st_mode & 0o111


def test_a_link_inside_is_packed_and_one_out_of_the_folder_refused(tmp_path: Path) -> None:
    tree(tmp_path, {"src/model.py": "m", "train.py": "t"})
    (tmp_path / "current").symlink_to("src")
    (tmp_path / "src/up.py").symlink_to("../train.py")
    done = pack(tmp_path)
    out = tmp_path.parent / "unpacked"
    unpack(done.data, done.sha256, out)
    assert (out / "current/model.py").read_text() == "m" and (out / "src/up.py").read_text() == "t"
    (tmp_path / "src/escape").symlink_to("../../outside")
    with pytest.raises(PackRefused) as refused:
        pack(tmp_path)
    assert refused.value.entry == "src/escape"
    (tmp_path / "src/escape").unlink()
    (tmp_path / "abs").symlink_to("/etc/passwd")
    with pytest.raises(PackRefused, match="abs: a link to an absolute path"):
        pack(tmp_path)


def test_a_fifo_is_refused_naming_it_unless_ignored(tmp_path: Path) -> None:
    tree(tmp_path, {"train.py": "t"})
    os.mkfifo(tmp_path / "pipe")
    with pytest.raises(PackRefused, match="pipe: a fifo"):
        pack(tmp_path)
    (tmp_path / ".vigilignore").write_text("pipe\n")
    assert pack(tmp_path).entries == 2


def test_past_the_size_limit_the_error_names_the_largest_files(tmp_path: Path) -> None:
    tree(tmp_path, {"big.bin": b"\0" * (2 * MIB), "medium.bin": b"\0" * MIB, "train.py": "t"})
    with pytest.raises(PackRefused) as refused:
        pack(tmp_path, max_mb=2)
    message = str(refused.value)
    assert "VIGIL_CODE_MAX_MB (2 MB)" in message
    assert message.index("big.bin (2.0 MB)") < message.index("medium.bin (1.0 MB)")
    assert pack(tmp_path, max_mb=4).bytes == 3 * MIB + 1
    with pytest.raises(PackRefused, match=r"big\.bin"):  # the gateway's check says the same
        check(pack(tmp_path, max_mb=4).data, max_mb=2)


def crafted(*members: tuple[tarfile.TarInfo, bytes]) -> bytes:
    raw = io.BytesIO()
    with gzip.GzipFile(fileobj=raw, mode="wb") as gz, tarfile.open(fileobj=gz, mode="w") as tar:
        for info, data in members:
            info.size = len(data) if info.isreg() else 0
            tar.addfile(info, io.BytesIO(data) if info.isreg() else None)
    return raw.getvalue()


def entry(name: str, kind: bytes = tarfile.REGTYPE, link: str = "") -> tuple[tarfile.TarInfo, bytes]:
    info = tarfile.TarInfo(name)
    info.type, info.linkname = kind, link
    return info, b"data"


@pytest.mark.parametrize(
    ("members", "named", "why"),
    [
        ([entry("/etc/cron.d/x")], "/etc/cron.d/x", "an absolute path"),
        ([entry("a/../../x")], "a/../../x", "'..'"),
        ([entry("ok.py"), entry("dev", tarfile.CHRTYPE)], "dev", "a device file"),
        ([entry("blk", tarfile.BLKTYPE)], "blk", "a device file"),
        ([entry("f", tarfile.FIFOTYPE)], "f", "a fifo"),
        ([entry("l", tarfile.SYMTYPE, "/etc/shadow")], "l", "absolute path"),
        ([entry("d/l", tarfile.SYMTYPE, "../../x")], "d/l", "points out of the code"),
        # each link stays inside on its own; through the first, the second goes out
        ([entry("up", tarfile.SYMTYPE, "."), entry("out", tarfile.SYMTYPE, "up/..")], "out", "points out"),
        ([entry("a.py"), entry("h", tarfile.LNKTYPE, "a.py")], "h", "a hard link"),
        ([entry("a.py"), entry("a.py")], "a.py", "twice"),
    ],
)
def test_a_bad_pack_is_refused_naming_the_entry(
    members: list[tuple[tarfile.TarInfo, bytes]], named: str, why: str, tmp_path: Path
) -> None:
    data = crafted(*members)
    with pytest.raises(PackRefused, match=why) as refused:
        check(data)
    assert refused.value.entry == named
    assert refused.value.errors[0]["field"] == "code" and named in refused.value.errors[0]["message"]
    with pytest.raises(PackRefused):
        unpack(data, digest(data), tmp_path / "out")
    assert not (tmp_path / "out").exists()  # nothing written


def test_bytes_that_are_not_a_pack_are_refused() -> None:
    with pytest.raises(PackRefused, match="not a gzipped tar"):
        check(b"not a tar at all")


def test_a_pack_unpacks_only_under_its_own_hash(tmp_path: Path) -> None:
    tree(tmp_path / "src", {"train.py": "t"})
    done = pack(tmp_path / "src")
    with pytest.raises(PackRefused, match="hash to"):
        unpack(done.data, "0" * 64, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_the_client_reads_its_limit_from_the_environment() -> None:
    assert max_mb_from({}) == 100 and max_mb_from({"VIGIL_CODE_MAX_MB": "2.5"}) == 2.5
    with pytest.raises(Exception, match="VIGIL_CODE_MAX_MB"):
        max_mb_from({"VIGIL_CODE_MAX_MB": "lots"})
