"""Benchmarks (`vigil bench NAME`): each measures its floor in the same run and prints one JSON line last."""

from __future__ import annotations

import asyncio
import contextlib
import math
import os
import sys
import tempfile
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from vigil_common.embedded import EmbeddedNats, EmbeddedPostgres
from vigil_common.settings import Settings


def result(bench: str, value: float, floor: float, unit: str, target: str, **details: Any) -> dict[str, Any]:
    """The one result shape every `vigil bench` prints as its last line: value, floor and their ratio,
    plus details."""
    ratio = value / floor if floor else float("inf")
    return {
        "bench": bench,
        "value": round(value, 6),
        "floor": round(floor, 6),
        "ratio": round(ratio, 4),
        "unit": unit,
        "target": target,
        **details,
    }


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile: the smallest value with at least `q` (0..1) of the values at or below it."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))]


def servers(
    stack: contextlib.ExitStack, settings: Settings, *, database: bool = True
) -> tuple[Settings, str]:
    """Settings pointing at the user's NATS/Postgres when given, else at embedded servers started in a
    temporary data dir for this run (closed with `stack`); and a line saying which."""
    tmp = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="vigil-bench-")))
    updates: dict[str, object] = {"data_dir": tmp, "metrics_port": 0}
    where = []
    if not settings.nats_url:
        updates["nats_url"] = stack.enter_context(EmbeddedNats(tmp / "nats")).url
        where.append("embedded nats-server -js (file storage, sync_interval: always)")
    if database and not settings.database_url:
        updates["database_url"] = stack.enter_context(EmbeddedPostgres(tmp / "postgres")).url
        where.append("embedded Postgres")
    return settings.model_copy(update=updates), ", ".join(where) or "the user's servers"


async def measure_on_servers(
    measure: Callable[[Settings], Awaitable[dict[str, Any]]], settings: Settings, *, database: bool = True
) -> dict[str, Any]:
    """`measure(settings)` against the servers for this run (`servers`), its result saying which."""
    with contextlib.ExitStack() as stack:
        settings, where = servers(stack, settings, database=database)
        out = await measure(settings)
        out["servers"] = where
        return out


async def start_service(settings: Settings, module: str) -> tuple[asyncio.subprocess.Process, dict[str, str]]:
    """The service `module` (its `run`) as its own process through `run_service`, as in production, on
    the bench's servers; and its environment. Its heap is its own (the bench's events are not in it)."""
    assert settings.nats_url and settings.database_url
    env = {
        **os.environ,
        "VIGIL_NATS_URL": settings.nats_url,
        "VIGIL_DATABASE_URL": settings.database_url,
        "VIGIL_DATA_DIR": str(settings.data_dir),
        "VIGIL_LOG_LEVEL": "ERROR",
        "VIGIL_WEBHOOK_URLS": "[]",
        "VIGIL_METRICS_PORT": "0",
    }
    code = (
        "from vigil_common.service import run_service; from vigil_common.settings import Settings; "
        f"from {module} import run; run_service(run, Settings.load())"
    )
    return await asyncio.create_subprocess_exec(sys.executable, "-c", code, env=env), env


async def stop_service(proc: asyncio.subprocess.Process, timeout_s: float = 30.0) -> None:
    """SIGTERM, then SIGKILL if it has not exited within `timeout_s`."""
    if proc.returncode is None:
        proc.terminate()
    try:
        await asyncio.wait_for(proc.wait(), timeout_s)
    except TimeoutError:
        proc.kill()
        await proc.wait()
