"""The web console: server-rendered pages (Jinja templates) served by the gateway at `/`, behind the
API's token (a login page exchanges it for a cookie), with uPlot (vendored under static/vendor) for
the curves and server-sent events for live updates. Reads go through the read model; nothing here
writes but submit and cancel, which call the scheduler like the API does.

Pages: `/` jobs (filter, submit, cancel), `/jobs/{id}` a job live from one document (header, curves
with incidents, halts, rollbacks and attempts marked, attempts, checkpoints, incidents; `console.jobpage`
and `console.live`), `/jobs/{id}/trace?step=` the step trace, `/cluster` nodes, GPU grid and NVLink
topology, `/cluster/{node}/{index}` one GPU's history, `/incidents` a live feed.

Every console answer carries a strict Content-Security-Policy (scripts, styles and connections from
the console itself only: no inline script or style, so the templates hold none), and may not be
framed or sniffed; `console.auth` says who may read and write.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from litestar import Router
from litestar.connection import ASGIConnection
from litestar.di import Provide
from litestar.handlers.base import BaseRouteHandler
from litestar.static_files import create_static_files_router
from litestar.template.config import TemplateConfig
from litestar.types import ASGIApp, Message, Receive, Scope, Send

from vigil.jobstates import TERMINAL_STATES, JobState
from vigil_common.settings import Settings

try:
    from litestar.plugins.jinja import JinjaTemplateEngine
except ImportError:  # litestar before 2.15
    from litestar.contrib.jinja import JinjaTemplateEngine  # type: ignore[no-redef]
from vigil_scheduler.console.auth import ConsoleAuth, LoginRequired, login_required
from vigil_scheduler.console.pages import ConsoleController, ConsoleDataController, LoginController

HERE = Path(__file__).parent
STATIC_PATH = "/console/static"
CSP = "; ".join(
    (
        "default-src 'self'",
        "script-src 'self'",
        "style-src 'self'",
        "img-src 'self' data:",
        "connect-src 'self'",
        "object-src 'none'",
        "base-uri 'none'",
        "form-action 'self'",
        "frame-ancestors 'none'",
    )
)
SECURITY_HEADERS = (
    (b"content-security-policy", CSP.encode()),
    (b"x-frame-options", b"DENY"),
    (b"x-content-type-options", b"nosniff"),
    (b"referrer-policy", b"same-origin"),
)


def security_headers(app: ASGIApp) -> ASGIApp:
    """Middleware: the headers above on every console response, errors and redirects included."""

    async def middleware(scope: Scope, receive: Receive, send: Send) -> None:
        async def send_with_headers(message: Message) -> None:
            if message["type"] == "http.response.start":
                headers = list(message.get("headers", ()))
                present = {bytes(name).lower() for name, _ in headers}
                headers += [h for h in SECURITY_HEADERS if h[0] not in present]
                message = {**message, "headers": headers}  # type: ignore[typeddict-item]
            await send(message)

        await app(scope, receive, send_with_headers)

    return middleware


def _template_globals(engine: JinjaTemplateEngine) -> None:
    """The job states' vocabulary for every template: `JobState` (its members, in order) and `FINISHED`
    (the states no transition leaves), so no template spells a state."""
    engine.engine.globals.update(JobState=JobState, FINISHED=TERMINAL_STATES)


def template_config() -> TemplateConfig:
    return TemplateConfig(
        directory=HERE / "templates", engine=JinjaTemplateEngine, engine_callback=_template_globals
    )


def console_routes(settings: Settings) -> list[Router]:
    """The login page and static files (open), and every page and data route (behind the token)."""
    auth = ConsoleAuth(settings)

    def provide_settings() -> Settings:
        return settings

    def provide_auth() -> ConsoleAuth:
        return auth

    async def guard(connection: ASGIConnection[Any, Any, Any, Any], handler: BaseRouteHandler) -> None:
        await auth.guard(connection, handler)  # a function: Litestar deep-copies a bound method's object

    pages = Router(
        "/",
        route_handlers=[ConsoleController, ConsoleDataController],
        guards=[guard],
        dependencies={
            "settings": Provide(provide_settings, sync_to_thread=False),
            "auth": Provide(provide_auth, sync_to_thread=False),
        },
        exception_handlers={LoginRequired: login_required},
        middleware=[security_headers],
        include_in_schema=False,
    )
    public = Router(
        "/",
        route_handlers=[LoginController],
        dependencies={"auth": Provide(provide_auth, sync_to_thread=False)},
        middleware=[security_headers],
        include_in_schema=False,
    )
    static = create_static_files_router(
        STATIC_PATH, directories=[HERE / "static"], middleware=[security_headers], include_in_schema=False
    )
    return [public, pages, static]
