"""A path under a root with no way out: the one rule for a checkpoint under the checkpoint root
(`manifest.confine`) and for what a spec names under the allowed roots (`vigil_common.confine.within`).

A path is taken only if it is spelled under a root (the root itself may be named through a link of its
own), has no `..`, and no symlink lies between the root and it: a link inside a root could lead out of
it, or be pointed elsewhere between the check and the open. The path returned is under the root's real
path, so what the caller opens is what was checked.
"""

from __future__ import annotations

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
