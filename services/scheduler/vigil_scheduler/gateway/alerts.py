"""Alert routes over HTTP (`/api/v1/alerts/routes`): make, list, delete, and read a route's delivery log.
A user sees and deletes their own routes and their team's; another's is a 404, as a job is."""

from __future__ import annotations

from typing import Annotated

import asyncpg
from litestar import Controller, Request, delete, get, post
from litestar.di import NamedDependency
from litestar.params import JSONBody, Parameter
from litestar.status_codes import HTTP_200_OK, HTTP_201_CREATED

from vigil.api_alerts import (
    ROUTE_ID,
    AlertDeliveryList,
    AlertDeliveryOut,
    AlertRouteCreated,
    AlertRouteIn,
    AlertRouteList,
    AlertRouteOut,
)
from vigil_scheduler import alert_routes
from vigil_scheduler.gateway.auth import principal
from vigil_scheduler.gateway.params import Limit
from vigil_scheduler.gateway.schemas import error_responses

Pool = NamedDependency[asyncpg.Pool]
RouteId = Annotated[str, Parameter(pattern=ROUTE_ID, description="an alert route's id (`r-...`)")]


class AlertRouteController(Controller):
    path = "/alerts/routes"
    tags = ["alerts"]

    @post(
        "/",
        status_code=HTTP_201_CREATED,
        summary="Make an alert route (a `json` route's signing secret is in the answer, shown once)",
        responses=error_responses(401, 413, 422),
    )
    async def create_route(
        self, request: Request, pool: Pool, data: JSONBody[AlertRouteIn]
    ) -> AlertRouteCreated:
        async with pool.acquire() as conn, conn.transaction():
            row = await alert_routes.create(conn, data, principal(request))
        return AlertRouteCreated.model_validate(row)

    @get(
        "/",
        summary="The alert routes this token sees: its own and its team's",
        responses=error_responses(401),
    )
    async def list_routes(self, request: Request, pool: Pool) -> AlertRouteList:
        rows = await alert_routes.list_routes(pool, principal(request))
        return AlertRouteList(items=[AlertRouteOut.model_validate(r) for r in rows])

    @get("/{route_id:str}", summary="One alert route", responses=error_responses(401, 404, 422))
    async def get_route(self, request: Request, pool: Pool, route_id: RouteId) -> AlertRouteOut:
        return AlertRouteOut.model_validate(await alert_routes.get(pool, route_id, principal(request)))

    @delete(
        "/{route_id:str}",
        status_code=HTTP_200_OK,
        summary="Delete an alert route and its delivery log",
        responses=error_responses(401, 404, 422),
    )
    async def delete_route(self, request: Request, pool: Pool, route_id: RouteId) -> AlertRouteOut:
        async with pool.acquire() as conn, conn.transaction():
            row = await alert_routes.delete(conn, route_id, principal(request))
        return AlertRouteOut.model_validate(row)

    @get(
        "/{route_id:str}/deliveries",
        summary="A route's delivery log, newest first: status, attempts, last error, times",
        responses=error_responses(401, 404, 422),
    )
    async def deliveries(
        self, request: Request, pool: Pool, route_id: RouteId, limit: Limit = 100
    ) -> AlertDeliveryList:
        rows = await alert_routes.deliveries(pool, route_id, principal(request), limit)
        return AlertDeliveryList(items=[AlertDeliveryOut.model_validate(r) for r in rows])
