"""`vigil users ...`: who a token is, and (with an admin's token) users, their tokens, teams and GPU quotas.

vigil users add alice --team vision --gpus 8   # create or update; prints nothing secret
vigil users token alice                        # a new token for alice, shown once
vigil users revoke alice                       # every token of alice stops working
vigil users team vision --gpus 16              # the team's quota (--no-limit to lift it)
vigil users token-hash                         # a token and its SHA-256, for VIGIL_USERS_FILE
"""

from __future__ import annotations

import click
from rich.console import Console
from rich.table import Table

from vigil_cli.jobs import as_json, connect, json_option, url_option


def _quota(gpus: int | None) -> str:
    return "no limit" if gpus is None else f"{gpus} GPUs"


def register(group: click.Group) -> None:
    @group.group("users")
    def users() -> None:
        """Users, their API tokens, teams and GPU quotas (all but `whoami` and `token-hash`: admin only)."""

    @users.command("whoami")
    @url_option
    @json_option
    def whoami(url: str | None, json_out: bool) -> None:
        """Who the token in use stands for."""
        me = connect(url).me()
        if json_out:
            click.echo(as_json(me))
        else:
            team = f", team {me.team}" if me.team else ""
            click.echo(f"{me.name}{team}{' (admin)' if me.admin else ''}; audited as {me.actor}")

    @users.command("list")
    @url_option
    @json_option
    def list_users(url: str | None, json_out: bool) -> None:
        """Every user with its team, admin flag, quota and live tokens."""
        found = connect(url).users()
        if json_out:
            click.echo(as_json(found))
            return
        table = Table("NAME", "TEAM", "ADMIN", "QUOTA", "TOKENS", "FROM", box=None)
        for u in found.items:
            table.add_row(
                u.name, u.team or "-", "yes" if u.admin else "-", _quota(u.gpus), str(u.tokens), u.source
            )
        Console().print(table)

    @users.command("add")
    @click.argument("name")
    @click.option("--team", help="the user's team: its members see and cancel each other's jobs")
    @click.option("--admin", is_flag=True, help="sees and cancels every job, manages users")
    @click.option(
        "--gpus", type=click.IntRange(min=0), help="devices its jobs may hold at once (default: no limit)"
    )
    @url_option
    @json_option
    def add(
        name: str, team: str | None, admin: bool, gpus: int | None, url: str | None, json_out: bool
    ) -> None:
        """Create or update user NAME (then `vigil users token NAME` gives it a token)."""
        user = connect(url).put_user(name, team=team, admin=admin, gpus=gpus)
        if json_out:
            click.echo(as_json(user))
        else:
            click.echo(f"user {user.name}: team {user.team or '-'}, quota {_quota(user.gpus)}")

    @users.command("token")
    @click.argument("name")
    @url_option
    @json_option
    def token(name: str, url: str | None, json_out: bool) -> None:
        """A new API token for user NAME, printed once (only its hash is kept)."""
        issued = connect(url).issue_token(name)
        click.echo(as_json(issued) if json_out else issued.token)

    @users.command("revoke")
    @click.argument("name")
    @url_option
    @json_option
    def revoke(name: str, url: str | None, json_out: bool) -> None:
        """Revoke every API token of user NAME."""
        revoked = connect(url).revoke_tokens(name)
        click.echo(as_json(revoked) if json_out else f"{revoked.revoked} token(s) of {revoked.user} revoked")

    @users.command("team")
    @click.argument("name")
    @click.option("--gpus", type=click.IntRange(min=0), help="devices the team's jobs may hold at once")
    @click.option("--no-limit", is_flag=True, help="lift the team's quota")
    @url_option
    @json_option
    def team(name: str, gpus: int | None, no_limit: bool, url: str | None, json_out: bool) -> None:
        """Set team NAME's GPU quota."""
        if (gpus is None) == (not no_limit):
            raise click.UsageError("give one of --gpus N or --no-limit")
        result = connect(url).put_team(name, gpus=gpus)
        click.echo(as_json(result) if json_out else f"team {result.name}: quota {_quota(result.gpus)}")

    @users.command("token-hash")
    def token_hash() -> None:
        """A new token and its SHA-256: give the user the token, put the hash in VIGIL_USERS_FILE."""
        from vigil_scheduler.principals import new_token, token_sha256  # the gateway's own rule

        made = new_token()
        click.echo(f"token:        {made}\ntoken_sha256: {token_sha256(made)}")
