"""How a rank's end reaches the worker: its exit codes, the exit file it leaves behind, and the last
step it reported (written beside the exit file when its link closes; a rank killed by a signal
leaves none, and its RankExited.last_step stays None).

Exit codes: 0 done; 1 anything else (traceback in the log); 2 bad spec or arguments; 3 no usable
checkpoint; 4 preempted (every rank wrote the emergency checkpoint first); 5 stopped to be relaunched
from a checkpoint (a program that cannot roll back in place; rank 0 reported `RestartRequested`); 6
parked: a collective failed (a peer died) and the built-in trainer's process waits for its job's next
attempt (`vigil_trainer.park`: the worker reports it as this exit code, the process lives on); an
injected crash exits with the code its fault names.
"""

from __future__ import annotations

import os
from pathlib import Path

EXIT_OK, EXIT_ERROR, EXIT_SPEC, EXIT_CHECKPOINT, EXIT_PREEMPTED, EXIT_RESTART = 0, 1, 2, 3, 4, 5
EXIT_PARKED = 6


def write_exit_file(code: int) -> None:
    """Leave the exit code where the worker looks for it (VIGIL_EXIT_FILE), for a worker that restarted
    meanwhile and so is not this process's parent any more."""
    if path := os.environ.get("VIGIL_EXIT_FILE"):
        Path(path).write_text(f"{code}\n")


def last_step_path(exit_path: str | Path) -> Path:
    """Where a rank notes the last step it reported: beside its exit file."""
    return Path(exit_path).with_suffix(".step")


def write_last_step(step: int) -> None:
    """Note `step` as the last one this rank reported (for the worker's RankExited.last_step)."""
    if path := os.environ.get("VIGIL_EXIT_FILE"):
        last_step_path(path).write_text(f"{step}\n")


def read_last_step(exit_path: str | Path) -> int | None:
    """The last step the rank with this exit file reported; None if it reported none."""
    try:
        return int(last_step_path(exit_path).read_text().strip())
    except (FileNotFoundError, ValueError):
        return None
