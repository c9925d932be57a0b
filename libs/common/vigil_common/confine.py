"""What a spec or a command may name on disk, and who may read what Vigil writes there.

- `within` takes a user-given path only if it lies under one of the allowed roots with no `..` and no
  symlink on the way (`vigil.paths`, the rule checkpoints follow too): a spec's `data.path` and
  `data.tokenizer` (roots: `VIGIL_DATA_ROOTS`, by default the data dir) and `entrypoint.workdir`
  (`VIGIL_CODE_ROOTS`), so no spec reads `/etc/shadow` or `/proc/self/environ` through the worker.
- `private_dir` makes a folder only its owner can list or enter (0700): the data dir, the token cache.
  Files Vigil writes in them are 0600 (`vigil up` and the services also set umask 077 for what
  libraries write, DeepSpeed's checkpoint shards among them).
"""

from __future__ import annotations

import os
import stat
from collections.abc import Sequence
from pathlib import Path

from vigil.paths import PathRefused, under

PRIVATE_UMASK = 0o077


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


def private_umask() -> int:
    """Make every file and folder this process (and its children) creates owner-only from now on;
    returns the previous umask."""
    return os.umask(PRIVATE_UMASK)


def let_traverse(path: Path) -> list[Path]:
    """Let other users reach `path` through the folders above it: search (x) permission only, so a private
    folder (0700) becomes 0711, never listable or readable by others. Returns the folders changed."""
    changed = []
    for folder in path.parents:
        mode = stat.S_IMODE(folder.stat().st_mode)
        if mode & 0o011 != 0o011:
            os.chmod(folder, mode | 0o011)
            changed.append(folder)
    return changed
