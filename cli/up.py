"""`vigil up`: the whole stack on this machine."""

from __future__ import annotations

import click


def register(group: click.Group) -> None:
    @group.command("up")
    def up() -> None:
        """Run the whole stack here: NATS, Postgres, migrations, services, gateway, a local worker."""
        raise click.ClickException("not yet")
