"""`vigil alerts ...`: alert routes, theirs and their team's, and each route's delivery log.

vigil alerts list
vigil alerts add oncall https://hooks.example/vigil     # json, signed: prints its secret once
vigil alerts add ml-slack https://hooks.slack.com/services/... --format slack --team ml --kind nan --kind hang
vigil alerts add ops http://alertmanager:9093 --format alertmanager --min-severity error
vigil alerts deliveries r-0123456789abcdef
vigil alerts rm r-0123456789abcdef
"""

from __future__ import annotations

import click
from rich.console import Console
from rich.table import Table

from vigil.alerts import SEVERITIES
from vigil.api_alerts import FORMATS, AlertFilter
from vigil_cli.jobs import as_json, connect, json_option, url_option


def _filter(route: AlertFilter) -> str:
    parts = [
        f"{name}={','.join(values)}"
        for name, values in route.model_dump(exclude={"min_severity"}).items()
        if values
    ]
    if route.min_severity != "info":
        parts.append(f">={route.min_severity}")
    return " ".join(parts) or "everything"


def register(group: click.Group) -> None:
    @group.group("alerts")
    def alerts() -> None:
        """Alert routes: where incidents go (signed JSON, Slack, Alertmanager), and what was delivered."""

    @alerts.command("list")
    @url_option
    @json_option
    def list_routes(url: str | None, json_out: bool) -> None:
        """The routes you see: your own and your team's."""
        found = connect(url).alert_routes()
        if json_out:
            click.echo(as_json(found))
            return
        table = Table("ID", "NAME", "FORMAT", "OWNER", "TEAM", "FILTER", "URL", box=None)
        for r in found.items:
            table.add_row(r.id, r.name, r.format, r.owner, r.team or "-", _filter(r.filter), r.url)
        Console().print(table)

    @alerts.command("add")
    @click.argument("name")
    @click.argument("target_url", metavar="URL")
    @click.option("--format", "fmt", type=click.Choice(FORMATS), default="json", show_default=True)
    @click.option("--team", help="your team's route (everyone in it sees it), not yours alone")
    @click.option("--kind", "kinds", multiple=True, help="only incidents of this kind (repeatable)")
    @click.option("--action", "actions", multiple=True, help="only incidents answered so (repeatable)")
    @click.option("--job", "jobs", multiple=True, help="only this job's incidents (repeatable)")
    @click.option(
        "--for-team", "teams", multiple=True, help="only incidents of this team's jobs (repeatable)"
    )
    @click.option("--min-severity", type=click.Choice(SEVERITIES), default="info", show_default=True)
    @url_option
    @json_option
    def add(
        name: str,
        target_url: str,
        fmt: str,
        team: str | None,
        kinds: tuple[str, ...],
        actions: tuple[str, ...],
        jobs: tuple[str, ...],
        teams: tuple[str, ...],
        min_severity: str,
        url: str | None,
        json_out: bool,
    ) -> None:
        """Send incidents to URL as NAME. A json route's signing secret is printed once: keep it."""
        body = {
            "name": name,
            "url": target_url,
            "format": fmt,
            "team": team,
            "filter": {
                "kinds": list(kinds),
                "actions": list(actions),
                "jobs": list(jobs),
                "teams": list(teams),
                "min_severity": min_severity,
            },
        }
        made = connect(url).add_alert_route(body)
        if json_out:
            click.echo(as_json(made))
            return
        click.echo(f"route {made.id} ({made.format}) -> {made.url}: {_filter(made.filter)}")
        if made.secret:
            click.echo(
                f"signing secret (shown once; vigil.alerts.verify checks deliveries with it): {made.secret}"
            )

    @alerts.command("rm")
    @click.argument("route_id")
    @url_option
    @json_option
    def remove(route_id: str, url: str | None, json_out: bool) -> None:
        """Delete a route and its delivery log."""
        gone = connect(url).remove_alert_route(route_id)
        click.echo(as_json(gone) if json_out else f"route {gone.id} ({gone.name}) deleted")

    @alerts.command("deliveries")
    @click.argument("route_id")
    @click.option("--limit", type=click.IntRange(1, 1000), default=50, show_default=True)
    @url_option
    @json_option
    def deliveries(route_id: str, limit: int, url: str | None, json_out: bool) -> None:
        """A route's delivery log, newest first: status, attempts, last error."""
        found = connect(url).alert_deliveries(route_id, limit=limit)
        if json_out:
            click.echo(as_json(found))
            return
        table = Table(
            "ID", "INCIDENT", "JOB", "KIND", "PHASE", "STATUS", "ATTEMPTS", "LAST ERROR", "UPDATED", box=None
        )
        for d in found.items:
            table.add_row(
                str(d.id), d.incident_id[:12], d.job_id or "-", d.kind, d.phase, d.status, str(d.attempts),
                d.last_error or "-", d.updated_at.strftime("%Y-%m-%d %H:%M:%S"),
            )  # fmt: skip
        Console().print(table)
