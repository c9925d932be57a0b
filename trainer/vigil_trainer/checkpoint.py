"""Checkpoints of the built-in trainer: DeepSpeed's files (under `ds/`) plus Vigil's manifest
(`vigil.manifest`), and reading torch files safely."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from vigil.integrations import ds_compat
from vigil.manifest import (
    MANIFEST,
    Manifest,
    checkpoints,
    confine,
    job_dir,
    newest_valid,
    retain,
    step_dir,
    step_of,
    verify,
    write_manifest,
)

__all__ = [  # the manifest's functions, re-exported for the trainer's modules
    "DS_TAG",
    "MANIFEST",
    "Manifest",
    "checkpoints",
    "confine",
    "job_dir",
    "newest_valid",
    "retain",
    "safe_load",
    "step_dir",
    "step_of",
    "use_safe_loading",
    "verify",
    "write_manifest",
]

DS_TAG = "ds"  # DeepSpeed's tag: its files live in <step dir>/ds/


def safe_load(path: Path, map_location: str | torch.device = "cpu") -> Any:
    """The only way Vigil reads a torch file: tensors and plain containers, never arbitrary pickles."""
    return torch.load(path, map_location=map_location, weights_only=True)


def use_safe_loading(engine: Any) -> None:
    """Make DeepSpeed read checkpoint files with `torch.load(weights_only=True)` (its default engine
    passes weights_only=False), allowing only the DeepSpeed classes its files are known to hold."""
    allowed = ds_compat.checkpoint_safe_globals()

    def load(path: str, map_location: Any = None) -> Any:
        with torch.serialization.safe_globals(allowed):
            return safe_load(Path(path), map_location=map_location or "cpu")

    ds_compat.read_checkpoints_with(engine, load)
