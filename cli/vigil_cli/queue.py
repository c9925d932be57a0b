"""`vigil queue`: the queued jobs in queue order, each with its position, why it waits and its estimated
start, and the teams' fair-share standings.

vigil queue            # a table
vigil queue --json     # the API's answer (GET /api/v1/queue)
"""

from __future__ import annotations

from datetime import datetime

import click
from rich.console import Console
from rich.table import Table

from vigil_cli.jobs import as_json, connect, json_option, url_option


def _when(moment: datetime | None) -> str:
    return "unknown" if moment is None else moment.strftime("%Y-%m-%d %H:%M UTC")


def register(group: click.Group) -> None:
    @group.command("queue")
    @url_option
    @json_option
    def queue(url: str | None, json_out: bool) -> None:
        """The queued jobs you may see, in queue order: position, why each waits, estimated start."""
        found = connect(url).queue()
        if json_out:
            click.echo(as_json(found))
            return
        console = Console()
        if not found.items:
            console.print("the queue is empty")
        else:
            table = Table(
                "POS", "JOB", "NAME", "TEAM", "PRIO", "GPUS", "EST. START", "WHY IT WAITS", box=None
            )
            for e in found.items:
                start = "now" if e.starting else _when(e.estimated_start)
                table.add_row(
                    str(e.position),
                    e.id,
                    e.name,
                    e.team or "-",
                    str(e.priority),
                    str(e.gpus),
                    start,
                    e.reason,
                )
            console.print(table)
        if found.teams:
            shares = Table("TEAM", "SHARE", "USAGE", "GPU-HOURS", "USAGE/SHARE", "FACTOR", box=None)
            for t in found.teams:
                shares.add_row(
                    t.team or "(no team)",
                    f"{t.share:.0%}",
                    f"{t.usage:.0%}",
                    f"{t.gpu_hours:.1f}",
                    f"{t.ratio:.2f}x",
                    f"{t.factor:.3f}",
                )
            console.print(shares)
