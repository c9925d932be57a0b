"""The `vigil` command line. Each command group lives in its own module and is registered here."""

from __future__ import annotations

import importlib

import click

# Modules that define commands; each exposes `register(group)`.
COMMAND_MODULES: tuple[str, ...] = (
    "vigil_cli.worker",
    "vigil_cli.up",
    "vigil_cli.bench",
    "vigil_cli.jobs",
    "vigil_cli.observe",
    "vigil_cli.demo",
)


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="vigil")
def cli() -> None:
    """Vigil: a control plane for distributed LLM training that stops bad runs before they burn compute."""


for _name in COMMAND_MODULES:
    importlib.import_module(_name).register(cli)


def main() -> None:
    cli()
