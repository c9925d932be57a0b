"""A parked rank's marker is read by its worker while the rank lives: it is whole or absent, never empty."""

from __future__ import annotations

import contextlib
import threading
from pathlib import Path

from vigil import handover


def test_a_reader_never_sees_the_parked_marker_empty(tmp_path: Path) -> None:
    """The worker polls the marker (`vigil_worker.parked.newly_parked`); a plain write shows it an empty
    file between the open and the write, read as "a collective failed" instead of the rank's reason (a
    stop's CI failed so). Written 2,000 times beside a reader: every read finds the whole reason."""
    exit_path = tmp_path / "rank-0.exit"
    marker = handover.parked_marker(exit_path)
    seen: list[str] = []
    done = threading.Event()

    def read() -> None:
        while not done.is_set():
            with contextlib.suppress(FileNotFoundError):  # between an unlink and the next rename
                seen.append(marker.read_text())

    reader = threading.Thread(target=read)
    reader.start()
    try:
        for _ in range(2000):
            handover.write_parked_marker(exit_path, "RuntimeError: Connection closed by peer")
            marker.unlink()
    finally:
        done.set()
        reader.join()
    assert seen, "the reader never found the marker: nothing was tested"
    assert set(seen) == {"RuntimeError: Connection closed by peer\n"}
    assert list(tmp_path.iterdir()) == []  # no temporary file left beside the exit file
