"""Vigil's checkpoint manifest: what makes a folder of files a checkpoint Vigil trusts.

Layout: `<root>/<job_id>/step_<step:08d>/` holds the program's files (the built-in trainer's DeepSpeed
files under `ds/`) and `manifest.json`, which lists the SHA-256 and size of every file, the step and
the data position. The manifest is written last and made visible by an atomic rename, so a directory
without one is incomplete. Loading verifies every file against the manifest first and refuses a
corrupt checkpoint. No torch here: any training program (and `vigil checkpoint verify`) uses it.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from vigil.errors import CheckpointError
from vigil.paths import PathRefused, under

MANIFEST = "manifest.json"
FORMAT = "vigil-checkpoint/1"


class _FileEntry(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")
    bytes: int = Field(ge=0, le=2**62)
    sha256: str = Field(max_length=128)


class _ManifestBody(BaseModel):
    """What `verify` accepts in a manifest.json: written by `write_manifest`, read as untrusted input."""

    model_config = ConfigDict(strict=True, extra="ignore")
    format: Literal["vigil-checkpoint/1"]
    job_id: str = Field("", max_length=256)
    step: int = Field(ge=0, le=2**62)
    data_position: int = Field(ge=0, le=2**62)
    skip_windows: list[tuple[int, int]] = Field(default_factory=list, max_length=100_000)
    files: dict[str, _FileEntry] = Field(max_length=1_000_000)


def _problem(err: ValidationError) -> str:
    e = err.errors(include_url=False)[0]
    where = ".".join(str(p) for p in e["loc"]) or "(manifest)"
    more = f" (and {err.error_count() - 1} more)" if err.error_count() > 1 else ""
    return f"{where}: {e['msg']}{more}"


@dataclass(frozen=True)
class Manifest:
    path: Path  # the checkpoint directory
    job_id: str
    step: int
    data_position: int
    skip_windows: list[tuple[int, int]]
    files: dict[str, dict[str, Any]]  # relative path -> {"bytes", "sha256"}
    sha256: str  # of manifest.json itself

    @property
    def bytes(self) -> int:
        return sum(int(f["bytes"]) for f in self.files.values())


def job_dir(root: Path, job_id: str) -> Path:
    """A job's own checkpoint folder: the only place its rollbacks and resumes may load from."""
    return confine(root, Path(root) / job_id)


def step_dir(root: Path, job_id: str, step: int) -> Path:
    return confine(root, Path(root) / job_id / f"step_{step:08d}")


def confine(root: Path, path: str | Path) -> Path:
    """`path` resolved, if it lies under `root` with no `..` and no symlink on the way (`vigil.paths`, the
    rule a spec's paths follow too); CheckpointError naming why otherwise."""
    try:
        return under(path, [root])
    except PathRefused as exc:
        raise CheckpointError(
            f"checkpoint path {str(path)!r} {exc} (the checkpoint root is {Path(root).resolve()})"
        ) from exc


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def write_manifest(
    ckpt: Path, *, job_id: str, step: int, data_position: int, skip_windows: list[tuple[int, int]]
) -> Manifest:
    """Hash every file under `ckpt`; publish the manifest by atomic rename, the checkpoint's last write."""
    files: dict[str, dict[str, Any]] = {}
    for f in sorted(ckpt.rglob("*")):
        if f.is_symlink():
            raise CheckpointError(f"refusing to checkpoint a symlink: {f}")
        if f.is_file() and f.name != MANIFEST and not f.name.startswith(MANIFEST):
            files[f.relative_to(ckpt).as_posix()] = {"bytes": f.stat().st_size, "sha256": _sha256(f)}
    body = {
        "format": FORMAT,
        "job_id": job_id,
        "step": step,
        "data_position": data_position,
        "skip_windows": [list(w) for w in skip_windows],
        "created_at": datetime.now(UTC).isoformat(),
        "files": files,
    }
    raw = json.dumps(body, indent=1, sort_keys=True).encode()
    tmp = ckpt / f"{MANIFEST}.tmp"
    with tmp.open("wb") as fh:
        fh.write(raw)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, ckpt / MANIFEST)
    return Manifest(
        path=ckpt,
        job_id=job_id,
        step=step,
        data_position=data_position,
        skip_windows=[tuple(w) for w in skip_windows],  # type: ignore[misc]
        files=files,
        sha256=hashlib.sha256(raw).hexdigest(),
    )


def verify(path: str | Path, *, root: Path | None = None) -> Manifest:
    """Check a checkpoint against its manifest: every listed file present, same size, same SHA-256,
    nothing unlisted, no symlinks. With `root`, the path must lie under it. Raises CheckpointError."""
    ckpt = confine(root, path) if root is not None else Path(path).resolve()
    manifest_path = ckpt / MANIFEST
    if not manifest_path.is_file():
        raise CheckpointError(f"{ckpt}: no {MANIFEST} (incomplete or not a checkpoint)")
    raw = manifest_path.read_bytes()
    try:
        body = _ManifestBody.model_validate_json(raw)
    except ValidationError as exc:
        raise CheckpointError(f"{manifest_path}: unreadable manifest ({_problem(exc)})") from exc
    files = {rel: meta.model_dump() for rel, meta in body.files.items()}
    for rel, meta in files.items():
        rel_path = Path(rel)
        if "\x00" in rel or rel_path.is_absolute() or ".." in rel_path.parts:
            raise CheckpointError(f"{manifest_path}: file entry {rel!r} escapes the checkpoint")
        f = ckpt / rel_path
        if f.is_symlink() or not f.is_file():
            raise CheckpointError(f"{ckpt}: {rel} is missing or not a regular file")
        if f.stat().st_size != int(meta["bytes"]):
            raise CheckpointError(
                f"{ckpt}: {rel} has {f.stat().st_size} bytes, the manifest says {meta['bytes']}"
            )
        if _sha256(f) != meta["sha256"]:
            raise CheckpointError(f"{ckpt}: {rel} does not match its SHA-256 in the manifest (corrupt)")
    for f in ckpt.rglob("*"):
        rel = f.relative_to(ckpt).as_posix()
        if f.is_symlink():
            raise CheckpointError(f"{ckpt}: unexpected symlink {rel}")
        if f.is_file() and rel != MANIFEST and rel not in files:
            raise CheckpointError(f"{ckpt}: {rel} is not in the manifest")
    return Manifest(
        path=ckpt,
        job_id=body.job_id,
        step=body.step,
        data_position=body.data_position,
        skip_windows=list(body.skip_windows),
        files=files,
        sha256=hashlib.sha256(raw).hexdigest(),
    )


def step_of(path: str | Path) -> int | None:
    """The step a checkpoint directory's name says (`step_00000040` -> 40); None for any other name."""
    name = Path(path).name
    return int(name[5:]) if name.startswith("step_") and name[5:].isdigit() else None


def _step_dirs(job: Path) -> list[tuple[int, Path]]:
    """(step, dir) of every real `step_*` directory under a job's directory (complete or not)."""
    return [
        (s, p) for p in job.iterdir() if (s := step_of(p)) is not None and p.is_dir() and not p.is_symlink()
    ]


def checkpoints(root: Path, job_id: str) -> list[tuple[int, Path]]:
    """(step, dir) of every checkpoint directory with a manifest, oldest first (not verified)."""
    job = confine(root, Path(root) / job_id)
    if not job.is_dir():
        return []
    return sorted((s, p) for s, p in _step_dirs(job) if (p / MANIFEST).is_file())


def newest_valid(root: Path, job_id: str, *, at_or_before: int | None = None) -> Manifest | None:
    """The newest checkpoint that verifies, optionally no later than a step."""
    for step, path in reversed(checkpoints(root, job_id)):
        if at_or_before is not None and step > at_or_before:
            continue
        try:
            return verify(path, root=root)
        except CheckpointError:
            continue
    return None


def retain(root: Path, job_id: str, keep: int) -> list[Path]:
    """Delete all but the newest `keep` checkpoints (and incomplete directories older than them)."""
    done = checkpoints(root, job_id)
    if len(done) <= keep:
        return []
    oldest_kept = done[-keep][0]
    removed = []
    job = confine(root, Path(root) / job_id)
    for step, p in _step_dirs(job):
        if step < oldest_kept:
            shutil.rmtree(p)
            removed.append(p)
    return removed
