"""Users, teams, their tokens, quotas and fair-share weights in Postgres (migrations 0016, 0022), and the
authentication of a bearer token: the admin's (VIGIL_API_TOKEN, compared in constant time) or a user's
(its SHA-256 looked up, never the token itself)."""

from __future__ import annotations

import hmac
from dataclasses import dataclass
from typing import Any

import asyncpg

from vigil.errors import NotFound, SpecError
from vigil_scheduler import audit, fairshare
from vigil_scheduler.principals import (
    ADMIN,
    Principal,
    UsersFile,
    admin_principal,
    check_name,
    new_token,
    token_sha256,
    user_principal,
)

_USER_COLUMNS = "name, team, admin, gpus, source, created_at, updated_at"


class Authenticator:
    """The principal a bearer token stands for, or None. `pool` None: only the admin's token counts."""

    def __init__(self, admin_token: str, pool: asyncpg.Pool | None = None) -> None:
        self._admin_token = admin_token.encode()
        self._admin = admin_principal(admin_token)
        self.pool = pool

    async def principal(self, given: str) -> Principal | None:
        given = given.strip()
        if not given:
            return None
        if hmac.compare_digest(given.encode(), self._admin_token):
            return self._admin
        if self.pool is None:
            return None
        digest = token_sha256(given)
        row = await self.pool.fetchrow(
            """SELECT t.sha256, u.name, u.team, u.admin FROM api_tokens t JOIN users u ON u.name = t.user_name
               WHERE t.sha256 = $1 AND t.revoked_at IS NULL""",
            digest,
        )
        if row is None or not hmac.compare_digest(row["sha256"].encode(), digest.encode()):
            return None
        return user_principal(row["name"], row["team"], row["admin"])


@dataclass(frozen=True)
class UserChange:
    team: str | None = None
    admin: bool = False
    gpus: int | None = None


async def put_user(conn: asyncpg.Connection, name: str, change: UserChange, actor: str) -> dict[str, Any]:
    """Create or update a user (ValueError naming a bad name or team)."""
    _check_user_name(name)
    row = await conn.fetchrow(
        f"""INSERT INTO users (name, team, admin, gpus) VALUES ($1, $2, $3, $4)
            ON CONFLICT (name) DO UPDATE SET team = $2, admin = $3, gpus = $4, updated_at = now()
            RETURNING {_USER_COLUMNS}""",
        name,
        change.team,
        change.admin,
        change.gpus,
    )
    detail = {"user": name, "team": change.team, "admin": change.admin, "gpus": change.gpus}
    await audit.record(conn, "user", actor, None, detail=detail)
    return dict(row)


async def issue_token(conn: asyncpg.Connection, name: str, actor: str) -> str:
    """A new token for user `name` (NotFound when there is none); only its hash is stored."""
    token = new_token()
    found = await conn.fetchval(
        """INSERT INTO api_tokens (sha256, user_name) SELECT $1, name FROM users WHERE name = $2
           RETURNING user_name""",
        token_sha256(token),
        name,
    )
    if found is None:
        raise NotFound(f"no user {name!r}: create it first (PUT /api/v1/users/{name})")
    await audit.record(conn, "token", actor, None, detail={"user": name, "sha256": token_sha256(token)[:12]})
    return token


async def revoke_tokens(conn: asyncpg.Connection, name: str, actor: str) -> int:
    """Revoke every token of user `name`; how many were live. NotFound when there is no such user."""
    if not await conn.fetchval("SELECT true FROM users WHERE name = $1", name):
        raise NotFound(f"no user {name!r}")
    status = await conn.execute(
        "UPDATE api_tokens SET revoked_at = now() WHERE user_name = $1 AND revoked_at IS NULL", name
    )
    count = int(status.split()[-1])
    await audit.record(conn, "revoke", actor, None, detail={"user": name, "tokens": count})
    return count


async def put_team(conn: asyncpg.Connection, name: str, gpus: int | None, actor: str) -> dict[str, Any]:
    check_name(name, "team")
    row = await conn.fetchrow(
        """INSERT INTO teams (name, gpus) VALUES ($1, $2)
           ON CONFLICT (name) DO UPDATE SET gpus = $2, updated_at = now()
           RETURNING name, gpus, share, source""",
        name,
        gpus,
    )
    await audit.record(conn, "quota", actor, None, detail={"team": name, "gpus": gpus})
    return dict(row)


async def set_share(conn: asyncpg.Connection, name: str, share: float, actor: str) -> dict[str, Any]:
    """Set team `name`'s weight in the fair share (creating the team); SpecError naming a bad name or
    share."""
    try:
        check_name(name, "team")
    except ValueError as exc:
        raise SpecError([{"field": "name", "message": str(exc)}]) from exc
    try:
        share = fairshare.check_share(share)
    except ValueError as exc:
        raise SpecError([{"field": "share", "message": str(exc)}]) from exc
    row = await conn.fetchrow(
        """INSERT INTO teams (name, share) VALUES ($1, $2)
           ON CONFLICT (name) DO UPDATE SET share = $2, updated_at = now()
           RETURNING name, gpus, share, source""",
        name,
        share,
    )
    await audit.record(conn, "quota", actor, None, detail={"team": name, "share": share})
    return dict(row)


async def list_users(pool: asyncpg.Pool) -> list[dict[str, Any]]:
    rows = await pool.fetch(
        f"""SELECT {_USER_COLUMNS},
                   (SELECT count(*) FROM api_tokens t WHERE t.user_name = u.name AND t.revoked_at IS NULL)
                       AS tokens
            FROM users u ORDER BY name"""
    )
    return [dict(r) for r in rows]


async def list_teams(pool: asyncpg.Pool) -> list[dict[str, Any]]:
    return [dict(r) for r in await pool.fetch("SELECT name, gpus, share, source FROM teams ORDER BY name")]


async def sync_file(conn: asyncpg.Connection, users: UsersFile) -> None:
    """Make the file's users, teams and token hashes current (in the caller's transaction): the tokens
    the file gave before and no longer lists are deleted, so removing a hash from the file revokes it."""
    await conn.execute("DELETE FROM api_tokens WHERE source = 'file'")
    for team in users.teams:
        await conn.execute(
            """INSERT INTO teams (name, gpus, source, share) VALUES ($1, $2, 'file', coalesce($3, 1))
               ON CONFLICT (name) DO UPDATE SET gpus = $2, source = 'file', share = coalesce($3, teams.share),
                   updated_at = now()""",
            team.name,
            team.gpus,
            team.share,
        )
    for user in users.users:
        await conn.execute(
            """INSERT INTO users (name, team, admin, gpus, source) VALUES ($1, $2, $3, $4, 'file')
               ON CONFLICT (name) DO UPDATE SET team = $2, admin = $3, gpus = $4, source = 'file',
                   updated_at = now()""",
            user.name,
            user.team,
            user.admin,
            user.gpus,
        )
        for digest in user.token_sha256:
            await conn.execute(
                """INSERT INTO api_tokens (sha256, user_name, source) VALUES ($1, $2, 'file')
                   ON CONFLICT (sha256) DO UPDATE SET user_name = $2, source = 'file', revoked_at = NULL""",
                digest,
                user.name,
            )


def _check_user_name(name: str) -> None:
    try:
        check_name(name)
    except ValueError as exc:
        raise SpecError([{"field": "name", "message": str(exc)}]) from exc
    if name == ADMIN:
        message = f"{ADMIN!r} is the gateway token's principal; pick another user name"
        raise SpecError([{"field": "name", "message": message}])
