"""`vigil bench NAME`: run one benchmark and print its JSON result as the last line."""

from __future__ import annotations

import asyncio
import importlib
import inspect
import json

import click

from vigil_common.settings import Settings

# name -> module exposing `run(settings: Settings) -> dict` (sync or async).
BENCHES: dict[str, str] = {
    "bus": "vigil_bench.bus",
    "overhead": "vigil_bench.overhead",
    "recovery": "vigil_bench.recovery",
    "schedule": "vigil_bench.schedule",
    "guardian": "vigil_bench.guardian",
    "ingest": "vigil_bench.ingest",
    "detectors": "vigil_bench.detectors",
    "fleet": "vigil_bench.fleet",
    "scaling": "vigil_bench.scaling",
    "console": "vigil_bench.console",
    "sdk": "vigil_bench.sdk",
    "goodput": "vigil_bench.goodput",
    "mfu": "vigil_bench.mfu",
    "elastic": "vigil_bench.elastic",
    "queue": "vigil_bench.queue",
}


def register(group: click.Group) -> None:
    @group.command("bench")
    @click.argument("name", type=click.Choice(sorted(BENCHES)))
    def bench(name: str) -> None:
        """Run benchmark NAME; the last line printed is its JSON result (value, floor, ratio)."""
        settings = Settings.load()
        run = importlib.import_module(BENCHES[name]).run
        out = asyncio.run(run(settings)) if inspect.iscoroutinefunction(run) else run(settings)
        click.echo(json.dumps(out))
