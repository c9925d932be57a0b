"""Who may read what Vigil writes on disk: the control plane's side of it.

- `private_umask`: every file this process and its children create is owner-only (`vigil up` and the
  services set it for what libraries write, DeepSpeed's checkpoint shards among them); folders are made
  with `vigil.paths.private_dir` (0700), which the built-in trainer uses too.
- `let_traverse` lets a job's user reach its own folder through private ones (search bit only).

What a spec may name on disk is `vigil.paths.within`, the SDK's, beside the rule checkpoints follow.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

PRIVATE_UMASK = 0o077


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
