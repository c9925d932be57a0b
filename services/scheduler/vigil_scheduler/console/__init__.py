"""The web console: server-rendered pages (Jinja templates) served by the gateway at `/`, behind the
API's token (a login page exchanges it for a cookie), with uPlot (vendored under static/vendor) for
the curves and server-sent events for live updates. Reads go through the read model; nothing here
writes but submit and cancel, which call the scheduler like the API does.

Pages: `/` jobs (filter, submit, cancel), `/jobs/{id}` curves with incidents, halts, rollbacks and
attempts marked, `/jobs/{id}/trace?step=` the step trace, `/cluster` nodes, GPU grid and NVLink
topology, `/cluster/{node}/{index}` one GPU's history, `/incidents` a live feed.
"""

from __future__ import annotations

from pathlib import Path

from litestar import Router
from litestar.di import Provide
from litestar.static_files import create_static_files_router
from litestar.template.config import TemplateConfig

from vigil_common.settings import Settings

try:
    from litestar.plugins.jinja import JinjaTemplateEngine
except ImportError:  # litestar before 2.15
    from litestar.contrib.jinja import JinjaTemplateEngine  # type: ignore[no-redef]
from vigil_scheduler.console.auth import LoginRequired, console_guard, login_required
from vigil_scheduler.console.pages import ConsoleController, ConsoleDataController, LoginController

HERE = Path(__file__).parent
STATIC_PATH = "/console/static"


def template_config() -> TemplateConfig:
    return TemplateConfig(directory=HERE / "templates", engine=JinjaTemplateEngine)


def console_routes(settings: Settings) -> list[Router]:
    """The login page and static files (open), and every page and data route (behind the token)."""

    def provide_settings() -> Settings:
        return settings

    pages = Router(
        "/",
        route_handlers=[ConsoleController, ConsoleDataController],
        guards=[console_guard],
        dependencies={"settings": Provide(provide_settings, sync_to_thread=False)},
        exception_handlers={LoginRequired: login_required},
        include_in_schema=False,
    )
    public = Router("/", route_handlers=[LoginController], include_in_schema=False)
    static = create_static_files_router(STATIC_PATH, directories=[HERE / "static"], include_in_schema=False)
    return [public, pages, static]
