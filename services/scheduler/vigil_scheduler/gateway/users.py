"""Users, tokens, team quotas and fair-share weights over HTTP: `GET /me` for anyone, the rest for an
admin's token only."""

from __future__ import annotations

from typing import Annotated

import asyncpg
from litestar import Controller, Request, delete, get, post, put
from litestar.di import NamedDependency
from litestar.params import JSONBody, Parameter
from litestar.status_codes import HTTP_200_OK, HTTP_201_CREATED

from vigil.api import (
    PrincipalOut,
    RevokedOut,
    TeamIn,
    TeamList,
    TeamOut,
    TeamShareIn,
    TokenOut,
    UserIn,
    UserList,
    UserOut,
)
from vigil_scheduler import users
from vigil_scheduler.gateway.auth import actor, admin_guard, principal
from vigil_scheduler.gateway.schemas import error_responses
from vigil_scheduler.principals import NAME_PATTERN
from vigil_scheduler.users import UserChange

Pool = NamedDependency[asyncpg.Pool]
Name = Annotated[str, Parameter(pattern=NAME_PATTERN, description="a user's or team's name")]
ADMIN_ONLY = error_responses(401, 403, 422)
ADMIN_WRITE = error_responses(401, 403, 413, 422)  # a body: VIGIL_MAX_BODY_BYTES bounds it


class MeController(Controller):
    tags = ["users"]

    @get("/me", summary="Who this token stands for", responses=error_responses(401))
    async def me(self, request: Request) -> PrincipalOut:
        p = principal(request)
        return PrincipalOut(name=p.name, team=p.team, admin=p.admin, actor=p.actor)


class UserController(Controller):
    path = "/users"
    tags = ["users"]
    guards = [admin_guard]

    @get("/", summary="Users with their team, admin flag, GPU quota and live tokens", responses=ADMIN_ONLY)
    async def list_users(self, pool: Pool) -> UserList:
        return UserList(items=[UserOut.model_validate(u) for u in await users.list_users(pool)])

    @put(
        "/{name:str}",
        status_code=HTTP_200_OK,
        summary="Create or update a user: team, admin flag, GPU quota",
        responses=ADMIN_WRITE,
    )
    async def put_user(self, request: Request, pool: Pool, name: Name, data: JSONBody[UserIn]) -> UserOut:
        change = UserChange(team=data.team, admin=data.admin, gpus=data.gpus)
        async with pool.acquire() as conn, conn.transaction():
            row = await users.put_user(conn, name, change, actor(request))
        return UserOut.model_validate(row)

    @post(
        "/{name:str}/tokens",
        status_code=HTTP_201_CREATED,
        summary="A new token for the user (shown once; only its SHA-256 is kept)",
        responses=error_responses(401, 403, 404, 422),
    )
    async def issue_token(self, request: Request, pool: Pool, name: Name) -> TokenOut:
        async with pool.acquire() as conn, conn.transaction():
            token = await users.issue_token(conn, name, actor(request))
        return TokenOut(user=name, token=token)

    @delete(
        "/{name:str}/tokens",
        status_code=HTTP_200_OK,
        summary="Revoke every token of the user",
        responses=error_responses(401, 403, 404, 422),
    )
    async def revoke_tokens(self, request: Request, pool: Pool, name: Name) -> RevokedOut:
        async with pool.acquire() as conn, conn.transaction():
            count = await users.revoke_tokens(conn, name, actor(request))
        return RevokedOut(user=name, revoked=count)


class TeamController(Controller):
    path = "/teams"
    tags = ["users"]
    guards = [admin_guard]

    @get("/", summary="Teams with their GPU quota and fair-share weight", responses=ADMIN_ONLY)
    async def list_teams(self, pool: Pool) -> TeamList:
        return TeamList(items=[TeamOut.model_validate(t) for t in await users.list_teams(pool)])

    @put("/{name:str}", status_code=HTTP_200_OK, summary="Set a team's GPU quota", responses=ADMIN_WRITE)
    async def put_team(self, request: Request, pool: Pool, name: Name, data: JSONBody[TeamIn]) -> TeamOut:
        async with pool.acquire() as conn, conn.transaction():
            row = await users.put_team(conn, name, data.gpus, actor(request))
        return TeamOut.model_validate(row)

    @put(
        "/{name:str}/share",
        status_code=HTTP_200_OK,
        summary="Set a team's weight in the fair share (default 1)",
        responses=ADMIN_WRITE,
    )
    async def put_share(
        self, request: Request, pool: Pool, name: Name, data: JSONBody[TeamShareIn]
    ) -> TeamOut:
        async with pool.acquire() as conn, conn.transaction():
            row = await users.set_share(conn, name, data.share, actor(request))
        return TeamOut.model_validate(row)
