"""Code packages: a folder of the user's code packed into one gzipped tar, named by its SHA-256.

`vigil submit --code DIR` (`Client.submit(spec, code=DIR)`) packs the folder with `pack`, the gateway
refuses a bad pack with `check` (a 422 naming the entry) and keeps it by its hash, and each node's worker
`unpack`s the same bytes (checked again, hash first) into the attempt's own folder.

What is packed: every file under the folder but what `.gitignore` and `.vigilignore` files exclude (git's
rules, a deeper file over a shallower one, `.vigilignore` over `.gitignore` in the same folder; `.git/` is
never packed), regular files, folders and symlinks that stay inside the folder. A pack is deterministic:
entries sorted, owner 0, time 0, mode 0644 or 0755, so the same files give the same hash (stored once).

Refused (`PackRefused`): a link that points out of the pack (an absolute target, or `..` past its top,
through other links too), a hard link, a device file, a fifo or socket, an absolute path or a `..` in an
entry's name, and more than `max_mb` of files (the message names the largest).
"""

from __future__ import annotations

import gzip
import hashlib
import io
import os
import posixpath
import re
import stat
import tarfile
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

import pathspec

from vigil.errors import SpecError

DEFAULT_MAX_MB = 100.0  # VIGIL_CODE_MAX_MB's default (`vigil_common.settings`)
MAX_MB_ENV = "VIGIL_CODE_MAX_MB"
IGNORE_FILES = (".gitignore", ".vigilignore")  # in this order: the second overrides the first
NEVER = (".git",)  # folder names never packed
MAX_ENTRIES = 200_000
MIB = 1024 * 1024
SHA256 = re.compile(r"^[0-9a-f]{64}$")
_LINK_HOPS = 40  # as Linux's ELOOP


class PackRefused(SpecError):
    """A folder or pack that cannot be a code package; `entry` names the file (or "code" for the whole)."""

    def __init__(self, entry: str, message: str) -> None:
        self.entry = entry
        super().__init__(
            [{"field": "code", "message": f"{entry}: {message}" if entry != "code" else message}]
        )


@dataclass(frozen=True)
class Pack:
    """A packed folder: the gzipped tar's bytes, its SHA-256 (hex), its entries and its files' bytes."""

    data: bytes
    sha256: str
    entries: int
    bytes: int


def digest(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def max_mb_from(environ: Mapping[str, str]) -> float:
    """VIGIL_CODE_MAX_MB as a client finds it (the default where unset)."""
    raw = environ.get(MAX_MB_ENV)
    try:
        value = float(raw) if raw else DEFAULT_MAX_MB
    except ValueError:
        raise SpecError([{"field": MAX_MB_ENV, "message": f"{raw!r} is not a number of MB"}]) from None
    if value <= 0:
        raise SpecError([{"field": MAX_MB_ENV, "message": f"{raw!r} must be above 0"}])
    return value


# --- packing --------------------------------------------------------------------------------------------


def pack(folder: Path | str, *, max_mb: float = DEFAULT_MAX_MB) -> Pack:
    """`folder` packed (see the module's docstring); PackRefused naming the entry that cannot be packed,
    or the largest files when they exceed `max_mb`."""
    root = Path(folder).resolve()
    if not root.is_dir():
        raise PackRefused("code", f"{folder} is not a folder")
    entries = list(walk(root))
    links = {name: os.readlink(root / name) for name, kind, _ in entries if kind == "link"}
    for name in links:
        _link_inside(name, links)
    _fits([(name, size) for name, kind, size in entries if kind == "file"], max_mb)
    raw = io.BytesIO()
    with (
        gzip.GzipFile(fileobj=raw, mode="wb", mtime=0, compresslevel=6) as gz,
        tarfile.open(fileobj=gz, mode="w", format=tarfile.PAX_FORMAT) as tar,
    ):
        for name, kind, _ in entries:
            path = root / name
            info = tarfile.TarInfo(name)
            info.mtime, info.uid, info.gid, info.uname, info.gname = 0, 0, 0, "", ""
            if kind == "dir":
                info.type, info.mode = tarfile.DIRTYPE, 0o755
                tar.addfile(info)
            elif kind == "link":
                info.type, info.mode, info.linkname = tarfile.SYMTYPE, 0o777, os.readlink(path)
                tar.addfile(info)
            else:
                with open(path, "rb") as f:
                    info.size = os.fstat(f.fileno()).st_size
                    info.mode = 0o755 if os.stat(path).st_mode & 0o111 else 0o644
                    tar.addfile(info, f)
    data = raw.getvalue()
    return Pack(data, digest(data), len(entries), sum(size for *_, size in entries))


def walk(root: Path) -> Iterator[tuple[str, str, int]]:
    """What `pack` packs of `root`, in order: (name relative to root, "dir" | "file" | "link", bytes)."""
    rules: dict[str, list[pathspec.GitIgnoreSpec]] = {}
    for top, dirs, files in os.walk(root):
        here = Path(top).relative_to(root).as_posix()
        here = "" if here == "." else here
        rules[here] = [_rules(Path(top) / n) for n in IGNORE_FILES if (Path(top) / n).is_file()]
        kept_dirs = []
        for name in sorted(dirs):
            rel = f"{here}/{name}" if here else name
            if name in NEVER or _ignored(rel, True, rules):
                continue
            if os.path.islink(Path(top) / name):  # os.walk lists a link to a folder among the folders
                files.append(name)
                continue
            kept_dirs.append(name)
            yield rel, "dir", 0
        dirs[:] = kept_dirs
        for name in sorted(files):
            rel = f"{here}/{name}" if here else name
            path = Path(top) / name
            if _ignored(rel, False, rules):
                continue
            mode = os.lstat(path).st_mode
            if stat.S_ISLNK(mode):
                yield rel, "link", 0
            elif stat.S_ISREG(mode):
                yield rel, "file", os.lstat(path).st_size
            else:
                raise PackRefused(rel, f"{_kind(mode)} cannot be packed: add it to .vigilignore")


def _rules(path: Path) -> pathspec.GitIgnoreSpec:
    return pathspec.GitIgnoreSpec.from_lines(path.read_text(errors="replace").splitlines())


def _ignored(rel: str, is_dir: bool, rules: dict[str, list[pathspec.GitIgnoreSpec]]) -> bool:
    """git's answer for `rel`: the last rule that matches it, from the top folder's files to its own."""
    ignored = False
    parts = rel.split("/")
    for depth in range(len(parts)):
        base = "/".join(parts[:depth])
        below = "/".join(parts[depth:]) + ("/" if is_dir else "")
        for spec in rules.get(base, []):
            found = spec.check_file(below)
            if found.include is not None:
                ignored = found.include
    return ignored


def _fits(files: list[tuple[str, int]], max_mb: float) -> None:
    total = sum(size for _, size in files)
    if total <= max_mb * MIB:
        return
    largest = sorted(files, key=lambda f: -f[1])[:5]
    named = ", ".join(f"{name} ({_size(size)})" for name, size in largest)
    raise PackRefused(
        "code",
        f"the code is {_size(total)}, over VIGIL_CODE_MAX_MB ({max_mb:g} MB); the largest files: "
        f"{named}. Add what the job does not need to .vigilignore, or raise VIGIL_CODE_MAX_MB",
    )


def _size(n: int) -> str:
    return f"{n / MIB:.1f} MB" if n >= MIB // 10 else f"{n / 1024:.1f} KB"


def _kind(mode: int) -> str:
    if stat.S_ISCHR(mode) or stat.S_ISBLK(mode):
        return "a device file"
    if stat.S_ISFIFO(mode):
        return "a fifo"
    if stat.S_ISSOCK(mode):
        return "a socket"
    return "a special file"


def _link_inside(name: str, links: Mapping[str, str]) -> None:
    """PackRefused unless the link `name` resolves inside the pack, following the pack's other links."""
    if links[name].startswith("/"):
        raise PackRefused(name, f"a link to an absolute path ({links[name]}) points out of the code")
    stack = [p for p in posixpath.dirname(name).split("/") if p]
    pending = links[name].split("/")
    hops = 0
    while pending:
        part = pending.pop(0)
        if part in ("", "."):
            continue
        if part == "..":
            if not stack:
                raise PackRefused(name, f"a link to {links[name]} points out of the code")
            stack.pop()
            continue
        stack.append(part)
        target = links.get("/".join(stack))
        if target is not None:  # through another link of the pack
            hops += 1
            if hops > _LINK_HOPS or target.startswith("/"):
                raise PackRefused(name, f"a link to {links[name]} points out of the code")
            stack.pop()
            pending = target.split("/") + pending


# --- checking and unpacking ------------------------------------------------------------------------------


def check(data: bytes, *, max_mb: float = DEFAULT_MAX_MB) -> Pack:
    """What the gateway and each worker ask of a pack's bytes before they keep or unpack them: a gzipped
    tar of folders, regular files and links that stay inside it, no name twice, no absolute name or `..`,
    at most `max_mb` of files. PackRefused naming the first entry that breaks a rule."""
    files: list[tuple[str, int]] = []
    links: dict[str, str] = {}
    seen: set[str] = set()
    try:
        with tarfile.open(fileobj=io.BytesIO(data), mode="r:gz") as tar:
            for member in tar:
                name = _name(member.name)
                if name in seen:
                    raise PackRefused(name, "is in the pack twice")
                seen.add(name)
                if len(seen) > MAX_ENTRIES:
                    raise PackRefused("code", f"the pack holds more than {MAX_ENTRIES} entries")
                if member.issym():
                    links[name] = member.linkname
                elif member.islnk():
                    raise PackRefused(name, "a hard link: pack a copy of the file")
                elif member.isreg():
                    files.append((name, member.size))
                    if sum(size for _, size in files) > max_mb * MIB:
                        _fits(files, max_mb)
                elif not member.isdir():
                    raise PackRefused(name, f"{_member_kind(member)} cannot be in a code pack")
    except (tarfile.TarError, EOFError, OSError, gzip.BadGzipFile) as exc:
        raise PackRefused("code", f"not a gzipped tar ({exc})") from None
    for name in links:
        _link_inside(name, links)
    return Pack(data, digest(data), len(seen), sum(size for _, size in files))


def _name(raw: str) -> str:
    if raw.startswith("/"):
        raise PackRefused(raw, "an absolute path: entries are named relative to the pack's top")
    parts = [p for p in raw.split("/") if p not in ("", ".")]
    if ".." in parts:
        raise PackRefused(raw, "'..' in an entry's name")
    if not parts or "\x00" in raw:
        raise PackRefused(raw or "(empty)", "not a file name")
    return "/".join(parts)


def _member_kind(member: tarfile.TarInfo) -> str:
    if member.ischr() or member.isblk():
        return "a device file"
    if member.isfifo():
        return "a fifo"
    return "a special entry"


def unpack(data: bytes, sha256: str, dest: Path, *, max_mb: float = DEFAULT_MAX_MB) -> Pack:
    """`data` unpacked into the empty or new folder `dest` once it is the pack `sha256` names and passes
    `check`. PackRefused (nothing written) when its bytes hash to something else, or it breaks a rule."""
    if (found := digest(data)) != sha256:
        raise PackRefused("code", f"the pack's bytes hash to {found}, not {sha256}: nothing was run")
    checked = check(data, max_mb=max_mb)
    dest.mkdir(parents=True, exist_ok=True)
    with tarfile.open(fileobj=io.BytesIO(data), mode="r:gz") as tar:
        tar.extractall(dest, filter="data")  # refuses again what `check` did (links out, devices)
    return checked
