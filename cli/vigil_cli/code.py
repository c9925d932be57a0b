"""`vigil jobs code JOB`: the code package a job runs (`vigil submit --code DIR` uploaded it), saved as a
gzipped tar or unpacked into a folder."""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import click

from vigil import codepack
from vigil.client import Client


def register(group: click.Group, url_option: Callable[[Any], Any]) -> None:
    @group.command("code")
    @click.argument("job_id")
    @click.option(
        "-o",
        "--output",
        type=click.Path(path_type=Path),
        help="where to write it (default: <JOB>-<hash>.tar.gz here; a folder with --extract)",
    )
    @click.option("--extract", is_flag=True, help="unpack it into --output (a new or empty folder)")
    @url_option
    def code(job_id: str, output: Path | None, extract: bool, url: str | None) -> None:
        """Download the code package JOB runs: the bytes it was submitted with, checked by their hash."""
        client = Client.from_env(url)
        data = client.code(job_id)
        sha256 = codepack.digest(data)
        if extract:
            dest = output or Path(f"{job_id}-code")
            if dest.exists() and any(dest.iterdir()):
                raise click.ClickException(f"{dest} is not empty: name a new or empty folder with --output")
            codepack.unpack(data, sha256, dest, max_mb=math.inf)  # the gateway held it to its own limit
        else:
            dest = output or Path(f"{job_id}-{sha256[:12]}.tar.gz")
            dest.write_bytes(data)
        click.echo(f"{dest}: code package {sha256} ({len(data)} bytes)")
