"""A path under a root with no way out: the one rule for a checkpoint under the checkpoint root
(`manifest.confine`) and for what a spec names under the allowed roots (`within`): a spec's `data.path`
and `data.tokenizer` (roots: `VIGIL_DATA_ROOTS`, by default the data dir) and `entrypoint.workdir`
(`VIGIL_CODE_ROOTS`), so no spec reads `/etc/shadow` or `/proc/self/environ` through the worker or the
built-in trainer. And a folder only its owner may list or enter (`private_dir`).

A path is taken only if it is spelled under a root (the root itself may be named through a link of its
own), has no `..`, and no symlink lies between the root and it: a link inside a root could lead out of
it, or be pointed elsewhere between the check and the open. The path returned is under the root's real
path, so what the caller opens is what was checked.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Sequence
from pathlib import Path


class PathRefused(ValueError):
    """A path that is not plainly under a root. The message says why, starting with a verb ("contains
    '..'", "goes through the symlink ...", "is outside"), for the caller to prefix with the path."""


def under(path: str | Path, roots: Sequence[str | Path], *, relative_to: Path | None = None) -> Path:
    """`path` as a real path under the first of `roots` it is spelled under; PathRefused otherwise. A
    relative `path` is taken from `relative_to` (default: the first root). A part that does not exist yet
    is allowed: nothing there can be a link."""
    if not roots:
        raise PathRefused("has no root to lie under")
    raw = Path(path)
    if ".." in raw.parts:
        raise PathRefused("contains '..'")
    if not raw.is_absolute():
        raw = (relative_to or Path(roots[0]).resolve()) / raw
    for root in roots:
        real = Path(root).resolve()
        for base in (real, Path(root).absolute()):  # the root may be named through a link of its own
            if raw == base or raw.is_relative_to(base):
                current = real
                for part in raw.relative_to(base).parts:  # down from the root: no symlink on the way
                    current = current / part
                    if current.is_symlink():
                        raise PathRefused(f"goes through the symlink {current}")
                return current
    raise PathRefused("is outside")


class OutsideRoots(ValueError):
    """A path not plainly under an allowed root: outside them, through a symlink, or with `..`."""


def within(
    path: str | Path,
    roots: Sequence[Path],
    *,
    relative_to: Path | None = None,
    setting: str = "VIGIL_DATA_ROOTS",
) -> Path:
    """`path` under one of `roots` (themselves resolved) with no `..` and no symlink between the root and
    it (`vigil.paths.under`); OutsideRoots otherwise, naming why and `setting` (the variable that sets
    the roots). A relative `path` is taken from `relative_to` (default: the first root)."""
    if not roots:
        raise OutsideRoots(f"no allowed roots are configured ({setting})")
    try:
        return under(path, roots, relative_to=relative_to)
    except PathRefused as exc:
        names = ", ".join(str(Path(r).resolve()) for r in roots)
        reason = "is outside" if str(exc) == "is outside" else f"{exc}, which counts as outside"
        raise OutsideRoots(f"{path} {reason} the allowed roots ({names}); see {setting}") from exc


def private_dir(path: Path) -> Path:
    """`path` created 0700 if missing; if it exists, nobody but its owner may list it or write in it any
    more (0700). A search (x) bit others already have is kept (0711): the embedded Postgres, run as its
    own user under root, reaches its folder through the data dir that way, and can list nothing."""
    path.mkdir(parents=True, exist_ok=True, mode=0o700)
    mode = stat.S_IMODE(path.stat().st_mode)
    if mode & 0o066 or mode & 0o700 != 0o700:
        os.chmod(path, mode & 0o711 | 0o700)
    return path
