"""A rank's own stack dump, the worker's fallback when py-spy cannot read the process (no ptrace here, no
py-spy on the node): `faulthandler` on SIGUSR2 writes every thread's Python stack, from its C signal
handler (so also while a thread is stuck in C: a collective, a sleep, a lock), to a file beside the
rank's exit file. The file's existence tells the worker the handler is there: a rank without it (a program
that never called `vigil.init()`) is never sent the signal, whose default action would end it. Inert
outside Vigil (no VIGIL_EXIT_FILE)."""

from __future__ import annotations

import faulthandler
import os
import signal
from pathlib import Path
from typing import IO

SIGNAL = signal.SIGUSR2
_file: IO[str] | None = None  # kept open: faulthandler writes to its descriptor


def stacks_path(exit_path: str | Path) -> Path:
    """Where a rank's stack dumps go: beside its exit file."""
    return Path(exit_path).with_suffix(".stacks")


def install() -> bool:
    """Dump every thread's stack to `stacks_path` on SIGUSR2 (once per process); False outside Vigil."""
    global _file
    path = os.environ.get("VIGIL_EXIT_FILE")
    if not path:
        return False
    if _file is None:
        _file = stacks_path(path).open("a")
        faulthandler.register(SIGNAL, file=_file, all_threads=True, chain=False)
    return True
