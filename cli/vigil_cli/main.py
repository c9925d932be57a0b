"""The `vigil` command line. Each command group lives in its own module and is registered here.

A Vigil error (a bad setting, an unreachable server, a refused checkpoint, an API error with the fields
it names) ends any command with the lines naming the problem and exit code 1; anything else is a bug
and keeps its traceback.
"""

from __future__ import annotations

from typing import Any

import click

from vigil.client import VigilError as ApiError
from vigil.errors import VigilError, first_error
from vigil_cli import alerts, bench, checkpoint, demo, jobs, observe, queue, services, slurm, teams, up, users


class VigilGroup(click.Group):
    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except (VigilError, ApiError, BaseExceptionGroup) as exc:
            if (error := first_error(exc, (VigilError, ApiError))) is None:
                raise
            raise click.ClickException(str(error)) from exc


@click.group(cls=VigilGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="vigil")
def cli() -> None:
    """Vigil: a control plane for distributed LLM training that stops bad runs before they burn compute."""


for _module in (services, up, demo, jobs, observe, checkpoint, bench, slurm, users, teams, queue, alerts):
    _module.register(cli)


def main() -> None:
    cli()
