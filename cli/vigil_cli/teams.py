"""`vigil teams ...`: teams with their GPU quota and fair-share weight (admin only).

vigil teams list                  # every team: quota, share
vigil teams set-share vision 3    # vision's weight in the fair share (1 unless set)
"""

from __future__ import annotations

import click
from rich.console import Console
from rich.table import Table

from vigil_cli.jobs import as_json, connect, json_option, url_option


def register(group: click.Group) -> None:
    @group.group("teams")
    def teams() -> None:
        """Teams: GPU quotas (`vigil users team`) and fair-share weights (admin only)."""

    @teams.command("list")
    @url_option
    @json_option
    def list_teams(url: str | None, json_out: bool) -> None:
        """Every team with its GPU quota and its weight in the fair share."""
        found = connect(url).teams()
        if json_out:
            click.echo(as_json(found))
            return
        table = Table("NAME", "QUOTA", "SHARE", "FROM", box=None)
        for t in found.items:
            table.add_row(
                t.name, "no limit" if t.gpus is None else f"{t.gpus} GPUs", f"{t.share:g}", t.source
            )
        Console().print(table)

    @teams.command("set-share")
    @click.argument("team")
    @click.argument("weight", type=float)
    @url_option
    @json_option
    def set_share(team: str, weight: float, url: str | None, json_out: bool) -> None:
        """Set TEAM's weight in the fair share to WEIGHT (> 0; 1 unless set).

        Jobs of equal priority go by each team's decayed GPU-hours over its share of the weights
        (VIGIL_FAIRSHARE_HALF_LIFE_H); quotas stay hard limits on top."""
        if not weight > 0:
            raise click.BadParameter(f"must be > 0, got {weight:g}", param_hint="WEIGHT")
        result = connect(url).set_share(team, weight)
        click.echo(as_json(result) if json_out else f"team {result.name}: share {result.share:g}")
