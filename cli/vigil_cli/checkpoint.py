"""`vigil checkpoint verify PATH`: check a checkpoint against its manifest."""

from __future__ import annotations

import json
from pathlib import Path

import click

from vigil.errors import CheckpointError


def register(group: click.Group) -> None:
    @group.group("checkpoint")
    def checkpoint() -> None:
        """Checkpoint tools."""

    @checkpoint.command("verify")
    @click.argument("path", type=click.Path(path_type=Path))
    @click.option("--json", "as_json", is_flag=True, help="print the result as JSON")
    def verify(path: Path, as_json: bool) -> None:
        """Check the checkpoint at PATH against its manifest (every file's size and SHA-256).

        Exits 0 when it verifies, 1 when it does not."""
        from vigil.manifest import verify as verify_checkpoint

        try:
            m = verify_checkpoint(path)
        except (CheckpointError, OSError) as exc:  # OSError: a file it cannot read
            if as_json:
                click.echo(json.dumps({"path": str(path), "valid": False, "error": str(exc)}))
            else:
                click.echo(f"INVALID {path}: {exc}", err=True)
            raise SystemExit(1) from exc
        result = {
            "path": str(m.path),
            "valid": True,
            "step": m.step,
            "data_position": m.data_position,
            "files": len(m.files),
            "bytes": m.bytes,
            "manifest_sha256": m.sha256,
        }
        if as_json:
            click.echo(json.dumps(result))
        else:
            click.echo(
                f"OK {m.path}: step {m.step}, {len(m.files)} files, {m.bytes} bytes, manifest {m.sha256[:16]}"
            )
