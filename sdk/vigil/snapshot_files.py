"""An in-memory snapshot's files on its node (`vigil.snapshot` takes them): under the job's snapshot folder
(`VIGIL_SNAPSHOT_DIR`, on /dev/shm), `world_<W>/rank_<r>/step_<S>.bin` (rank r's own, of a job of W ranks)
and `world_<W>/peer_<r>/step_<S>.bin` (rank r's shard held for it), each beside its `.json` manifest,
written last by an atomic rename: a torn snapshot has none and is never whole. The newest `KEEP` of each
are kept. A job that changed its size (elastic) finds the shards of its former size under their own
`world_<W>`, until the new size has a snapshot of its own."""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from vigil.errors import CheckpointError
from vigil.protocol import SNAPSHOT_DIR_ENV

log = logging.getLogger("vigil")

FORMAT = "vigil-snapshot/1"
KEEP = 2  # snapshots of each shard kept on a node (the newest may be torn when a rank dies)


class SnapshotManifest(BaseModel):
    """A snapshot's `.json`: read back as untrusted input."""

    model_config = ConfigDict(strict=True, extra="forbid")
    format: Literal["vigil-snapshot/1"] = FORMAT
    job_id: str = Field(max_length=256)
    rank: int = Field(ge=0, le=1_000_000, description="whose shard")
    step: int = Field(ge=0, le=2**62)
    data_position: int = Field(ge=0, le=2**62)
    skip_windows: list[tuple[int, int]] = Field(default_factory=list, max_length=100_000)
    bytes: int = Field(ge=0, le=2**62)
    sha256: str = Field(min_length=64, max_length=64)
    world: int | None = Field(None, ge=1, le=1_000_000, description="the job's ranks when it was taken")


def sha256_of(data: bytes | memoryview) -> str:
    return hashlib.sha256(data).hexdigest()


class SnapshotFolder:
    """One job's snapshot files on one node, of the job at one size (`world` ranks): the folder holds
    every local rank's, each its own files."""

    def __init__(self, root: Path, job_id: str, world: int = 1) -> None:
        self.root, self.job_id, self.world = root, job_id, world

    def shard_dir(self, kind: Literal["rank", "peer"], rank: int) -> Path:
        return self.root / f"world_{self.world}" / f"{kind}_{rank}"

    def at_world(self, world: int) -> SnapshotFolder:
        """The same job's files on this node of the job at `world` ranks."""
        return SnapshotFolder(self.root, self.job_id, world)

    def other_worlds(self) -> list[SnapshotFolder]:
        """The job's files on this node of its other sizes (elastic), by size."""
        found = (p.name.removeprefix("world_") for p in self.root.glob("world_*") if p.is_dir())
        return [self.at_world(int(w)) for w in sorted(found) if w.isdigit() and int(w) != self.world]

    def shards(self) -> list[tuple[Literal["rank", "peer"], int]]:
        """Every shard with a folder here: (kind, rank)."""
        out: list[tuple[Literal["rank", "peer"], int]] = []
        for kind in ("rank", "peer"):
            base = self.root / f"world_{self.world}"
            for p in base.glob(f"{kind}_*") if base.is_dir() else ():
                number = p.name.removeprefix(f"{kind}_")
                if number.isdigit():
                    out.append((kind, int(number)))  # type: ignore[arg-type]
        return sorted(out)

    def remove_world(self) -> None:
        """Every file of the job at this size, on this node."""
        shutil.rmtree(self.root / f"world_{self.world}", ignore_errors=True)

    def write(self, kind: Literal["rank", "peer"], m: SnapshotManifest, data: bytes | memoryview) -> None:
        """The snapshot's bytes, then its manifest by atomic rename (its last write); older ones pruned."""
        folder = self.shard_dir(kind, m.rank)
        # never a folder above the job's (the node's is its worker's, made before any rank starts): a rank
        # that made a missing node folder would own it, and lock every other job's ranks out of it
        for made in (self.root, folder.parent, folder):
            made.mkdir(mode=0o700, exist_ok=True)
        stem = folder / f"step_{m.step:08d}"
        with open(stem.with_suffix(".bin"), "wb") as fh:
            fh.write(data)
        tmp = stem.with_suffix(".json.tmp")
        tmp.write_text(m.model_dump_json())
        os.replace(tmp, stem.with_suffix(".json"))
        for step in self.steps(kind, m.rank)[:-KEEP]:
            self.remove(kind, m.rank, step)

    def steps(self, kind: Literal["rank", "peer"], rank: int) -> list[int]:
        """Steps with a manifest (not verified), oldest first."""
        folder = self.shard_dir(kind, rank)
        if not folder.is_dir():
            return []
        names = (p.name[5:13] for p in folder.glob("step_*.json"))
        return sorted(int(n) for n in names if n.isdigit())

    def read(self, kind: Literal["rank", "peer"], rank: int, step: int) -> tuple[SnapshotManifest, bytes]:
        """The snapshot's manifest and bytes, checked against each other; CheckpointError otherwise."""
        stem = self.shard_dir(kind, rank) / f"step_{step:08d}"
        try:
            m = SnapshotManifest.model_validate_json(stem.with_suffix(".json").read_bytes())
            data = stem.with_suffix(".bin").read_bytes()
        except (OSError, ValidationError) as exc:
            raise CheckpointError(f"snapshot {stem}: unreadable ({exc})") from exc
        if (m.job_id, m.rank, m.step) != (self.job_id, rank, step) or m.world not in (None, self.world):
            names = f"{m.job_id} rank {m.rank} step {m.step} world {m.world}"
            raise CheckpointError(f"snapshot {stem}: its manifest names {names}")
        if len(data) != m.bytes:
            raise CheckpointError(f"snapshot {stem}: {len(data)} bytes, its manifest says {m.bytes}")
        if sha256_of(data) != m.sha256:
            raise CheckpointError(f"snapshot {stem}: does not match its SHA-256 (corrupt)")
        return m, data

    def whole(self, kind: Literal["rank", "peer"], rank: int) -> tuple[int, ...]:
        """The steps whose snapshot verifies (a refused one is logged and removed)."""
        good = []
        for step in self.steps(kind, rank):
            try:
                self.read(kind, rank, step)
                good.append(step)
            except CheckpointError as exc:
                log.error("vigil: refusing in-memory snapshot: %s", exc)
                self.remove(kind, rank, step)
        return tuple(good)

    def remove(self, kind: Literal["rank", "peer"], rank: int, step: int) -> None:
        stem = self.shard_dir(kind, rank) / f"step_{step:08d}"
        for suffix in (".json", ".json.tmp", ".bin"):  # the manifest first: never whole half-removed
            stem.with_suffix(suffix).unlink(missing_ok=True)

    def remove_shard(self, kind: Literal["rank", "peer"], rank: int) -> None:
        shutil.rmtree(self.shard_dir(kind, rank), ignore_errors=True)


def snapshot_folder_from_env(job_id: str) -> SnapshotFolder | None:
    """The job's snapshot folder on this node, from `VIGIL_SNAPSHOT_DIR`; None without it."""
    path = os.environ.get(SNAPSHOT_DIR_ENV)
    return SnapshotFolder(Path(path), job_id) if path else None  # at its size: `at_world`
