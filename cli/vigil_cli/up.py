"""`vigil up`: the whole stack on this machine."""

from __future__ import annotations

import asyncio
from pathlib import Path

import click
from rich.console import Console

from vigil_cli.stack import SERVICES, infrastructure, run_services
from vigil_common.credentials import CREDENTIALS_FILE, redact
from vigil_common.service import install_stop_signals, setup_logging
from vigil_common.settings import Settings
from vigil_common.token import token_path


def register(group: click.Group) -> None:
    @group.command("up")
    @click.option("--data-dir", type=click.Path(path_type=Path), help="overrides VIGIL_DATA_DIR")
    @click.option("--http-port", type=int, help="overrides VIGIL_HTTP_PORT")
    def up(data_dir: Path | None, http_port: int | None) -> None:
        """Run the whole stack here: NATS and Postgres (embedded unless VIGIL_NATS_URL /
        VIGIL_DATABASE_URL are set), migrations, the services, the gateway and a local worker.
        Ctrl-C stops everything cleanly."""
        settings = Settings.load(data_dir=data_dir, http_port=http_port)
        setup_logging(settings)
        asyncio.run(_up(settings))


async def _up(settings: Settings) -> None:
    console = Console()
    stop = asyncio.Event()
    install_stop_signals(stop)
    async with infrastructure(settings) as infra:
        s = infra.settings
        console.print(f"[bold]vigil up[/bold]: data in {s.data_dir.resolve()}")
        nats_url, database_url = redact(s.nats_url or ""), redact(s.database_url or "")
        console.print(f"  NATS      {nats_url}{'  (embedded)' if 'nats' in infra.embedded else ''}")
        console.print(f"  Postgres  {database_url}{'  (embedded)' if 'postgres' in infra.embedded else ''}")
        if infra.role_urls:
            console.print(
                f"  secrets   {s.data_dir.resolve() / CREDENTIALS_FILE}  (one NATS user per service)"
            )
        console.print(f"  gateway   http://{s.http_host}:{s.http_port}  (token in {token_path(s)})")
        if s.metrics_port:
            console.print(f"  metrics   http://{s.http_host}:{s.metrics_port}/metrics")
        console.print(f"  services  {', '.join(name.split('.')[0] for name in SERVICES)}")
        console.print("Ctrl-C to stop.")
        await run_services(infra, stop)
    console.print("stopped cleanly.")
