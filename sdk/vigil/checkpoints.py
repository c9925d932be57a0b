"""The checkpoint protocol a rank's `Run` follows, the same for every program: where a checkpoint goes,
saving one (every rank writes its files, rank 0 seals them with the manifest and reports them), choosing
one to load (rank 0 verifies it, every rank loads the same), and refusing one that did not load."""

from __future__ import annotations

import logging
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

from vigil import collective, manifest
from vigil import events as ev
from vigil import protocol as proto
from vigil.errors import CheckpointError
from vigil.identity import Identity

log = logging.getLogger("vigil")


class Checkpoints:
    """One rank's side of the protocol for the run `identity` under `root` (None: the program runs alone
    and has nowhere to save); `emit` and `flush` reach the agent (the run's link)."""

    def __init__(
        self,
        root: Path | None,
        identity: Identity,
        *,
        keep: int,
        emit: Callable[[ev.Message], None],
        flush: Callable[[], Any],
    ) -> None:
        self.root = root
        self.identity, self.keep = identity, keep
        self._emit, self._flush = emit, flush

    def folder(self, step: int) -> Path:
        """Where the checkpoint of `step` goes: `<root>/<job>/step_<step:08d>`."""
        if self.root is None:
            raise RuntimeError(f"vigil: no checkpoint root ({proto.CHECKPOINT_ROOT_ENV} is not set)")
        return manifest.step_dir(self.root, self.identity.job_id, step)

    def save(
        self,
        step: int,
        save: Callable[[Path], Any],
        *,
        data_position: int,
        skip_windows: list[tuple[int, int]],
    ) -> Path:
        """Every rank: `save(path)` writes this rank's files; then rank 0 hashes them into the manifest
        (written last, by an atomic rename), keeps the newest `keep` and reports `CheckpointSaved`."""
        path = self.folder(step)
        if self.identity.rank == 0 and path.exists():  # an older timeline's checkpoint of this step
            shutil.rmtree(path)
        collective.barrier()
        path.mkdir(parents=True, exist_ok=True)
        save(path)
        collective.barrier()  # every rank's files are on disk
        if self.identity.rank == 0:
            m = manifest.write_manifest(
                path,
                job_id=self.identity.job_id,
                step=step,
                data_position=data_position,
                skip_windows=skip_windows,
            )
            assert self.root is not None
            manifest.retain(self.root, self.identity.job_id, self.keep)
            self._emit(
                ev.CheckpointSaved(
                    job_id=self.identity.job_id,
                    attempt=self.identity.attempt,
                    step=step,
                    path=str(path),
                    bytes=m.bytes,
                    manifest_sha256=m.sha256,
                    data_position=data_position,
                )
            )
            log.info("vigil: checkpoint of step %d saved in %s (%d bytes)", step, path, m.bytes)
        collective.barrier()
        return path

    def choose(self, requested: str, requested_step: int | None) -> manifest.Manifest:
        """Rank 0 verifies the checkpoint asked for (or falls back to the newest valid one before it) and
        every rank gets its choice, so all load the same one. CheckpointError when there is none."""
        if self.root is None:
            raise CheckpointError(f"no checkpoint root ({proto.CHECKPOINT_ROOT_ENV} is not set)")
        choice: list[Any] = [None, ""]
        if self.identity.rank == 0:
            job = manifest.job_dir(self.root, self.identity.job_id)
            try:
                choice[0] = manifest.verify(requested, root=job)
            except CheckpointError as exc:
                log.error("vigil: refusing checkpoint %s: %s", requested, exc)
                if requested_step is not None:
                    self.refuse(requested, requested_step, "hash", exc)
                before = None if requested_step is None else requested_step - 1
                choice[0] = manifest.newest_valid(self.root, self.identity.job_id, at_or_before=before)
                choice[1] = str(exc)
        collective.broadcast(choice)
        if choice[0] is None:
            raise CheckpointError(f"no valid checkpoint at or before step {requested_step}: {choice[1]}")
        return choice[0]

    def refuse(
        self, path: str | Path, step: int, reason: ev.CheckpointRefusal, error: BaseException | str
    ) -> None:
        """Report that the checkpoint `path` (of `step`) did not load on this rank (`reason` "hash": it
        failed its manifest; "load": it verified and still raised): the scheduler marks it bad and no
        relaunch or rollback takes it again. Waits until the report is stored (the rank may exit next)."""
        self._emit(
            ev.CheckpointRefused(
                job_id=self.identity.job_id,
                attempt=self.identity.attempt,
                step=step,
                path=str(path),
                reason=reason,
                message=str(error)[:2000],
                node=self.identity.node,
            )
        )
        self._flush()
