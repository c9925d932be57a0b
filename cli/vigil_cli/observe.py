"""`vigil watch`: live incidents and job events from the bus, for people and scripts."""

from __future__ import annotations

import asyncio
import contextlib
import sys
from typing import TextIO

import click

from vigil.events import (
    CheckpointSaved,
    GuardianSettingsChanged,
    IncidentRaised,
    JobStateChanged,
    Message,
    RankExited,
    RanksHalted,
    RankStarted,
    RollbackCompleted,
)
from vigil_common import subjects
from vigil_common.bus import Bus
from vigil_common.endpoints import resolve_urls
from vigil_common.service import install_stop_signals, require_urls, setup_logging
from vigil_common.settings import Settings
from vigil_common.waiting import STOPPED, unless_stopped


def register(group: click.Group) -> None:
    @group.command("watch")
    @click.option("--json", "as_json", is_flag=True, help="one JSON object per line, for scripts")
    @click.option("--job", "job_id", help="only this job's events")
    def watch(as_json: bool, job_id: str | None) -> None:
        """Live incidents and job events (state changes, ranks, checkpoints, rollbacks) until Ctrl-C."""
        settings = resolve_urls(Settings.load())
        setup_logging(settings)
        with contextlib.suppress(KeyboardInterrupt):
            asyncio.run(_watch(settings, job_id, as_json, sys.stdout))


async def _watch(settings: Settings, job_id: str | None, as_json: bool, out: TextIO) -> None:
    stop = asyncio.Event()
    install_stop_signals(stop)
    await watch_events(
        settings, job_id, lambda e: _print(out, format_json(e) if as_json else format_line(e)), stop
    )


def _print(out: TextIO, line: str) -> None:
    out.write(line + "\n")
    out.flush()


async def watch_events(  # type: ignore[no-untyped-def]
    settings: Settings, job_id: str | None, emit, stop: asyncio.Event, ready: asyncio.Event | None = None
) -> None:
    """Call `emit(event)` for each new incident and status event until `stop` is set (`ready` is set
    once the subscription is in place)."""
    require_urls(settings, "watch", database=False)
    assert settings.nats_url
    bus = await Bus.connect(settings.nats_url, name="vigil-watch", tls_ca=settings.nats_tls_ca)
    try:
        wanted = (
            (subjects.incident(job_id), subjects.job_status(job_id))
            if job_id
            else (subjects.ALL_INCIDENTS, subjects.ALL_STATUS)
        )
        async with bus.watch(*wanted) as events:
            if ready is not None:
                ready.set()
            stream = aiter(events)
            while (event := await unless_stopped(anext(stream), stop)) is not STOPPED:
                emit(event)
    finally:
        await bus.close()


def format_json(event: Message) -> str:
    return event.model_dump_json()


def format_line(event: Message) -> str:
    """One readable line per event."""
    when = event.occurred_at.strftime("%H:%M:%S.%f")[:-3]
    job = event.job_id or "-"
    head = f"{when}  {job}#{event.attempt}"
    if isinstance(event, IncidentRaised):
        where = " ".join(
            part
            for part in (
                f"step {event.step}" if event.step is not None else "",
                f"rank {event.rank}" if event.rank is not None else "",
                f"on {event.node}" if event.node else "",
                f"device {event.device}" if event.device is not None else "",
            )
            if part
        )
        return f"{head}  INCIDENT {event.kind} -> {event.action.upper()}  {where}: {event.message}"
    if isinstance(event, JobStateChanged):
        return f"{head}  STATE    {event.from_state or '-'} -> {event.to_state}  ({event.cause})"
    if isinstance(event, RankStarted):
        return f"{head}  RANK     {event.rank} started on {event.node} (pid {event.pid})"
    if isinstance(event, RankExited):
        code = f"exit {event.exit_code}" if event.exit_code is not None else f"signal {event.signal}"
        return f"{head}  RANK     {event.rank} exited on {event.node}: {event.failure} ({code})"
    if isinstance(event, CheckpointSaved):
        return f"{head}  CKPT     step {event.step} saved ({event.bytes} bytes) {event.path}"
    if isinstance(event, RanksHalted):
        return f"{head}  HALTED   at step {event.step}"
    if isinstance(event, RollbackCompleted):
        skip = f", data {event.skip_data[0]}..{event.skip_data[1]} skipped" if event.skip_data else ""
        return (
            f"{head}  ROLLBACK step {event.from_step} -> {event.to_step} in {event.duration_s:.2f}s{skip} "
            f"({event.checkpoint})"
        )
    if isinstance(event, GuardianSettingsChanged):
        what = ", ".join(f"{k}={v}" for k, v in event.changed.items())
        return f"{head}  GUARDIAN settings revision {event.revision} by {event.by}: {what}"
    return f"{head}  {event.type}"
