"""`vigil demo`: the whole stack, a two-rank tiny GPT with a NaN and a loss spike injected,
the guardian catching both, and a summary."""

from __future__ import annotations

import asyncio
import json
import logging
import math
import shutil
import time
from pathlib import Path
from typing import Any

import click
import httpx
from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

from vigil import events as ev
from vigil.spec import JobSpec
from vigil_cli.demo_report import HELD, Recording, plot, summarise
from vigil_cli.stack import SERVICES, infrastructure, run_services
from vigil_common import subjects
from vigil_common.bus import Bus
from vigil_common.embedded import free_port
from vigil_common.redact import redact_url
from vigil_common.service import install_stop_signals
from vigil_common.settings import Settings
from vigil_common.token import token_path


def demo_spec(steps: int) -> JobSpec:
    """Two CPU/GPU ranks of the tiny preset; a silent data corruption (a NaN) on rank 1, which a replay of
    the step does not reproduce, and a 50x loss spike in rank 0's data, which it does."""
    nan_at, spike_at = max(8, steps * 2 // 5), max(16, steps * 7 // 10)
    return JobSpec.model_validate(
        {
            "name": "vigil-demo",
            "resources": {"nodes": 1, "gpus_per_node": 2},
            "model": {"preset": "tiny", "seq_len": 64},
            "train": {"steps": steps, "micro_batch": 8, "lr": 1e-3, "seed": 0},
            "checkpoint": {"every": 5, "keep": 4},
            "guardian": {"nan": "rollback", "spike": "rollback", "spike_warmup": 5, "hang_timeout_s": 60},
            "faults": [
                {"kind": "sdc", "step": nan_at, "rank": 1},
                {"kind": "spike", "step": spike_at, "rank": 0, "factor": 50},
            ],
        }
    )


def register(group: click.Group) -> None:
    @group.command("demo")
    @click.option("--steps", type=click.IntRange(20, 10_000), default=60, show_default=True)
    @click.option("--json", "as_json", is_flag=True, help="print the summary as one JSON line last")
    @click.option("--data-dir", type=click.Path(path_type=Path), help="default: VIGIL_DATA_DIR/demo")
    @click.option("--timeout", "timeout_s", type=float, default=600, show_default=True)
    @click.option(
        "--stay", is_flag=True, help="keep the stack (and the web console) up after the run, until Ctrl-C"
    )
    def demo(steps: int, as_json: bool, data_dir: Path | None, timeout_s: float, stay: bool) -> None:
        """Start the stack, train a small GPT on two ranks with faults injected, watch Vigil
        catch and roll back each one, and print a summary. Exit 0 only when the job SUCCEEDED
        and every injected fault was caught. The web console's URL is printed at the start."""
        base = Settings.load()
        data_dir = (data_dir or base.data_dir / "demo").resolve()
        _fresh(data_dir, base.log_level)
        summary = asyncio.run(_demo(base, data_dir, steps, as_json, timeout_s, stay))
        raise SystemExit(0 if summary.get("ok") else 1)


def _fresh(data_dir: Path, log_level: str) -> None:
    """Clear the previous demo's run (its servers' data stays), and log services to a file."""
    for old in ("checkpoints", "logs", "traces.jsonl", "vigil.log", "worker", "loss.png"):
        target = data_dir / old
        shutil.rmtree(target, ignore_errors=True) if target.is_dir() else target.unlink(missing_ok=True)
    data_dir.mkdir(parents=True, exist_ok=True)
    # The services log to a file; the console shows the run itself.
    logging.basicConfig(
        filename=data_dir / "vigil.log",
        level=log_level,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        force=True,
    )


async def _demo(
    base: Settings, data_dir: Path, steps: int, as_json: bool, timeout_s: float, stay: bool = False
) -> dict[str, Any]:
    console = Console(stderr=as_json)
    settings = base.model_copy(
        update={
            "data_dir": data_dir,
            "http_port": free_port(),
            "metrics_port": free_port(),
            "cpu_slots": 2,
            "heartbeat_interval_s": 1.0,
            "gpu_sample_interval_s": 2.0,
            "trace_file": data_dir / "traces.jsonl",
        }
    )
    spec = demo_spec(steps)
    stop = asyncio.Event()
    install_stop_signals(stop)
    started = time.monotonic()
    async with infrastructure(settings) as infra:
        s = infra.settings
        where = f"NATS {redact_url(s.nats_url)}, Postgres {redact_url(s.database_url)}"
        console.print(f"[bold]vigil demo[/bold]: stack up ({where})")
        url = f"http://{s.http_host}:{s.http_port}/"
        console.print(f"  web console {url}  (log in with the token in {token_path(s)})")
        services = asyncio.create_task(run_services(infra, stop, SERVICES))
        bus = await Bus.connect(s.nats_url, "vigil-demo")
        try:
            rec, job_id = await _run_job(s, bus, spec, stop, console, timeout_s, services)
            paths = {
                "plot": str(data_dir / "loss.png"),
                "traces": str(data_dir / "traces.jsonl"),
                "logs": f"{data_dir / 'vigil.log'} (services), {s.log_dir} (ranks)",
                "checkpoints": str(s.checkpoint_root / job_id) if job_id else "",
                "console": f"{url}jobs/{job_id}" if job_id else url,
            }
            summary = summarise(rec, spec, wall_s=time.monotonic() - started, paths=paths)
            if rec.steps:
                plot(rec, Path(paths["plot"]))
            _print_summary(console, summary)
            if as_json:
                print(json.dumps(summary), flush=True)
            if stay and not stop.is_set() and not services.done():
                console.print(
                    f"--stay: the stack stays up; the run is at {paths['console']}. Ctrl-C to stop."
                )
                await stop.wait()
        finally:
            await bus.close()
            stop.set()
            await asyncio.gather(services, return_exceptions=True)
    return summary


async def _run_job(
    s: Settings,
    bus: Bus,
    spec: JobSpec,
    stop: asyncio.Event,
    console: Console,
    timeout_s: float,
    services: asyncio.Task[None],
) -> tuple[Recording, str]:
    base_url = f"http://{s.http_host}:{s.http_port}"
    headers = {"Authorization": f"Bearer {s.api_token}"}
    watched = (subjects.ALL_STEPS, subjects.ALL_STATUS, subjects.ALL_CMDS, subjects.ALL_INCIDENTS)
    async with bus.watch(*watched) as events, httpx.AsyncClient(base_url=base_url, headers=headers) as http:
        await _wait_ready(http, stop, services)
        resp = await http.post("/api/v1/jobs", json=spec.model_dump(mode="json"))
        if resp.status_code != 201:
            raise click.ClickException(f"submit failed: {resp.status_code} {resp.text}")
        job_id = resp.json()["id"]
        console.print(
            f"submitted [bold]{job_id}[/bold]: {spec.train.steps} steps on 2 ranks, faults: "
            + ", ".join(f"{f.kind}@{f.step}/rank{f.rank}" for f in spec.faults)
        )
        rec = Recording(job_id)
        progress = Progress(
            TextColumn("[bold]{task.fields[state]}"),
            BarColumn(),
            TextColumn("step {task.completed:.0f}/{task.total:.0f}"),
            TextColumn("loss {task.fields[loss]}"),
            TextColumn("{task.fields[tps]} tok/s"),
            TextColumn("MFU {task.fields[mfu]}"),
            TimeElapsedColumn(),
            console=console,
            transient=False,
        )
        with progress:
            bar = progress.add_task(
                "train", total=spec.train.steps, state="PENDING", loss="-", tps="-", mfu="-"
            )
            deadline = time.monotonic() + timeout_s
            tps: dict[int, float] = {}
            while rec.final_state not in ev.TERMINAL_STATES:
                if stop.is_set() or services.done():
                    break
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    console.print(f"[red]timed out after {timeout_s:.0f}s[/red]")
                    break
                event = await events.next(min(remaining, 1.0))
                if event is None:
                    continue
                rec.add(event)
                if event.job_id != job_id:
                    continue
                if isinstance(event, ev.StepCompleted):
                    tps[event.rank] = event.tokens_per_s
                    if event.rank == 0:
                        loss = f"{event.loss:.4f}" if math.isfinite(event.loss) else "[red]NaN[/red]"
                        mfu = "-" if event.mfu is None else f"{100 * event.mfu:.1f}%"
                        progress.update(
                            bar,
                            completed=event.step + 1,
                            loss=loss,
                            tps=f"{sum(tps.values()):,.0f}",
                            mfu=mfu,
                        )
                elif isinstance(event, ev.JobStateChanged):
                    progress.update(bar, state=event.to_state)
                elif isinstance(event, ev.IncidentRaised):
                    progress.console.print(
                        f"[red]incident[/red] {event.kind} at step {event.step} rank {event.rank}: "
                        f"{event.message} -> [bold]{event.action}[/bold]"
                    )
                elif isinstance(event, ev.RollbackCompleted):
                    skip = (
                        f", data {event.skip_data[0]}..{event.skip_data[1]} skipped"
                        if event.skip_data
                        else ""
                    )
                    progress.console.print(
                        f"[green]rolled back[/green] from step {event.from_step} to {event.to_step}{skip} "
                        f"in {event.duration_s:.2f}s"
                    )
    return rec, job_id


async def _wait_ready(http: httpx.AsyncClient, stop: asyncio.Event, services: asyncio.Task[None]) -> None:
    """The gateway answers /readyz and a worker has registered."""
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and not stop.is_set() and not services.done():
        try:
            ready = (await http.get("/readyz")).status_code == 200
            nodes = (await http.get("/api/v1/nodes")).json().get("items", []) if ready else []
            if any(n.get("alive") for n in nodes):
                return
        except httpx.HTTPError:
            pass
        await asyncio.sleep(0.2)  # polling the gateway while the stack starts, bounded by the deadline
    if services.done() and services.exception():
        raise click.ClickException(f"a service failed to start: {services.exception()}")
    raise click.ClickException("the stack did not become ready within 60s")


def _rollback_line(rb: dict[str, Any]) -> str:
    """One rollback of the summary; the data it skipped only where it skipped some."""
    line = f"  rollback from step {rb['from_step']} to {rb['checkpoint']} (step {rb['to_step']})"
    if rb["data_skipped"]:
        first, last = rb["data_skipped"]
        line += f", data {first}..{last} skipped"
    return line


def _print_summary(console: Console, summary: dict[str, Any]) -> None:
    ok = summary["ok"]
    console.rule("[bold green]rescued[/bold green]" if ok else "[bold red]not rescued[/bold red]")
    console.print(
        f"job {summary['job_id']}: {summary['state']} after {summary['steps_run']} steps run "
        f"(loss {summary['first_loss']:.4f} -> {summary['final_loss']:.4f}), {summary['wall_s']}s wall"
    )
    for inc in summary["incidents"]:
        if inc["action"] in HELD:
            continue  # the ranks' own recovery: below, with its attribution
        latency = (
            "" if inc["fault_to_command_s"] is None else f", fault to command {inc['fault_to_command_s']}s"
        )
        console.print(
            f"  incident {inc['kind']} at step {inc['step']} rank {inc['rank']}: {inc['action']}{latency}"
        )
    for held in summary["held_steps"]:
        console.print(
            f"  held step {held['step']} ({held['kind']}, {held['held_s']}s): {held['attribution']}"
        )
    for rb in summary["rollbacks"]:
        console.print(_rollback_line(rb))
    for fault in summary["faults"]:
        mark = "[green]caught[/green]" if fault["caught"] else "[red]missed[/red]"
        console.print(f"  injected {fault['fault']} at step {fault['step']} rank {fault['rank']}: {mark}")
    console.print(f"  time lost to faults: {summary['time_lost_s']}s")
    if summary.get("median_mfu") is not None:
        console.print(
            f"  median MFU per rank {100 * summary['median_mfu']:.1f}% "
            f"({summary['flops_per_token']:.3g} FLOPs per token)"
        )
    console.print(
        f"  loss curve: {summary['plot']}\n  traces: {summary['traces']}\n  logs: {summary['logs']}"
        f"\n  web console: {summary.get('console', '')}"
    )
