"""How a rank's end reaches the worker: its exit codes, and the exit file it leaves behind.

Exit codes: 0 done; 1 anything else (traceback in the log); 2 bad spec or arguments; 3 no usable
checkpoint; 4 preempted (every rank wrote the emergency checkpoint first); an injected crash exits with
the code its fault names.
"""

from __future__ import annotations

import os
from pathlib import Path

EXIT_OK, EXIT_ERROR, EXIT_SPEC, EXIT_CHECKPOINT, EXIT_PREEMPTED = 0, 1, 2, 3, 4


def write_exit_file(code: int) -> None:
    """Leave the exit code where the worker looks for it (VIGIL_EXIT_FILE), for a worker that restarted
    meanwhile and so is not this process's parent any more."""
    if path := os.environ.get("VIGIL_EXIT_FILE"):
        Path(path).write_text(f"{code}\n")
