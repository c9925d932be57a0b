"""The services, and running one: `vigil scheduler`, `vigil telemetry`, `vigil guardian`, `vigil worker`
each run one alone; `vigil up` runs them all in one process (`vigil_cli.stack`).

Both take one path: settings from VIGIL_* (flags override), and each service connects to NATS as its own
user (`nats_user`), whose URL comes from the environment, from a `vigil up` running on the same data dir
(alone), or from the NATS server `vigil up` started (together); then the service's `run(settings, stop)`
until SIGINT/SIGTERM. A bad setting or an unreachable server ends the command with one line naming it
(see `vigil_cli.main`), never a traceback.
"""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import Any

import click

from vigil_cli.guardian import set_settings
from vigil_common import credentials
from vigil_common.endpoints import resolve_urls
from vigil_common.service import run_service
from vigil_common.settings import Settings

# Every service `vigil up` runs, in start order, with its NATS user; each module exposes
# `run(settings, stop)`. A worker's user is its node's (`nats_user`).
WORKER = "worker"
SERVICE_ROLES = {
    "vigil_scheduler.main": credentials.SCHEDULER,
    "vigil_telemetry.main": credentials.TELEMETRY,
    "vigil_guardian.main": credentials.GUARDIAN,
    "vigil_worker.main": WORKER,
}
SERVICES: tuple[str, ...] = tuple(SERVICE_ROLES)


def nats_user(service: str, node_name: str) -> str:
    """The NATS user `service` connects as where each service has its own (`vigil up`, the deployments):
    its role's; a worker, its node's."""
    role = SERVICE_ROLES[service]
    return credentials.worker_role(node_name) if role == WORKER else role


def serve(module: str, **overrides: Any) -> None:
    """Run `module.run(settings, stop)`; the service module is imported only now (the worker's pulls in
    its own dependencies, which the other services do without). URLs found from a `vigil up` carry the
    service's own NATS credential."""
    settings = Settings.load(**overrides)
    settings = resolve_urls(settings, nats_user(module, settings.node_name))
    run_service(importlib.import_module(module).run, settings)


def register(group: click.Group) -> None:
    @group.command("scheduler")
    @click.option("--http-port", type=int, help="overrides VIGIL_HTTP_PORT")
    def scheduler(http_port: int | None) -> None:
        """Run the scheduler and its HTTP gateway: placement, the job state machine, the API."""
        serve("vigil_scheduler.main", http_port=http_port)

    @group.command("telemetry")
    def telemetry() -> None:
        """Run the telemetry service: store steps, GPU samples, status and incidents; trace steps; metrics."""
        serve("vigil_telemetry.main")

    @group.group("guardian", invoke_without_command=True)
    @click.pass_context
    def guardian(ctx: click.Context) -> None:
        """Run the guardian service: watch every step and GPU, raise incidents, halt and roll back.
        `vigil guardian set JOB key=value ...` changes a running job's settings instead."""
        if ctx.invoked_subcommand is None:
            serve("vigil_guardian.main")

    guardian.add_command(set_settings)

    @group.command("worker")
    @click.option("--node-name", help="overrides VIGIL_NODE_NAME")
    @click.option("--cpu-slots", type=int, help="overrides VIGIL_CPU_SLOTS (nodes without GPUs)")
    @click.option("--data-dir", type=click.Path(path_type=Path), help="overrides VIGIL_DATA_DIR")
    def worker(node_name: str | None, cpu_slots: int | None, data_dir: Path | None) -> None:
        """Run this node's worker: register its devices, heartbeat, and run the ranks launched here."""
        serve("vigil_worker.main", node_name=node_name, cpu_slots=cpu_slots, data_dir=data_dir)
