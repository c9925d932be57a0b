"""An `OPTIONS` request is answered with every method its path takes, in `Allow`.

Litestar 2 answers `OPTIONS` itself, but lists only the methods of the first handler registered on a
path (litestar#4169, fixed in Litestar 3): `OPTIONS /api/v1/jobs` said `OPTIONS, POST`, though the path
takes GET too. This middleware puts in the methods of the route the request matched, which Litestar
keeps whole. Any other request passes through untouched.
"""

from __future__ import annotations

from litestar.enums import ScopeType
from litestar.middleware import ASGIMiddleware
from litestar.routes import HTTPRoute
from litestar.types import ASGIApp, Message, Receive, Scope, Send


def route_methods(scope: Scope) -> set[str] | None:
    """The methods of the route whose handler `scope` matched; None where no route did."""
    handler = scope.get("route_handler")
    for route in scope["litestar_app"].routes:
        if isinstance(route, HTTPRoute) and handler in route.route_handlers:
            return set(route.methods)
    return None


class AllowEveryMethod(ASGIMiddleware):
    scopes = (ScopeType.HTTP,)

    async def handle(self, scope: Scope, receive: Receive, send: Send, next_app: ASGIApp) -> None:
        if scope["method"] != "OPTIONS":
            await next_app(scope, receive, send)
            return

        async def sending(message: Message) -> None:
            if message["type"] == "http.response.start" and (methods := route_methods(scope)):
                headers = [(k, v) for k, v in message.get("headers", []) if k.lower() != b"allow"]
                headers.append((b"allow", ", ".join(sorted(methods)).encode()))
                message = {**message, "headers": headers}  # type: ignore[typeddict-item]
            await send(message)

        await next_app(scope, receive, sending)
