"""The gateway's clients: `submit [--follow]`, `jobs`, `job ID`, `cancel ID`, `nodes`, `gpus`, `status`; rich
tables for people, `--json` for scripts.

Built on the SDK's HTTP client (`vigil.Client`), which talks to the gateway at VIGIL_API_URL or
VIGIL_HTTP_HOST:VIGIL_HTTP_PORT (or `--url`) with the bearer token from VIGIL_API_TOKEN, else the token
file `vigil up` writes in the data dir.
"""

from __future__ import annotations

import contextlib
import threading
from pathlib import Path
from typing import Any

import click
from pydantic import BaseModel
from rich.console import Console
from rich.table import Table

from vigil.client import Client, Event, VigilError
from vigil.events import JobStateChanged
from vigil.jobstates import TERMINAL_STATES, JobState
from vigil_cli import code as code_command

STATE_STYLE: dict[JobState, str] = {
    JobState.PENDING: "yellow",
    JobState.SCHEDULED: "cyan",
    JobState.RUNNING: "green",
    JobState.HALTED: "magenta",
    JobState.ROLLING_BACK: "magenta",
    JobState.SUCCEEDED: "bold green",
    JobState.FAILED: "bold red",
    JobState.CANCELLED: "dim",
}

url_option = click.option("--url", envvar="VIGIL_API_URL", help="the gateway (default: VIGIL_HTTP_HOST:PORT)")
json_option = click.option("--json", "json_out", is_flag=True, help="print JSON instead of a table")


def connect(url: str | None) -> Client:
    """The gateway's client as the CLI finds it (`Client.from_env`); its errors end the command with
    the status and the fields the gateway named (`vigil_cli.main`)."""
    return Client.from_env(url)


def as_json(model: BaseModel) -> str:
    return model.model_dump_json()


def _state(state: str) -> str:
    return f"[{STATE_STYLE.get(state, 'white')}]{state}[/]"


def _loss(value: float | None) -> str:
    return "-" if value is None else f"{value:.4f}"


def _nodes_of(job: dict[str, Any]) -> str:
    nodes: dict[str, int] = {}
    for p in job.get("placement") or []:
        nodes[p["node"]] = nodes.get(p["node"], 0) + 1
    return ", ".join(f"{n}x{c}" for n, c in nodes.items()) or "-"


def jobs_table(items: list[dict[str, Any]]) -> Table:
    table = Table("ID", "NAME", "STATE", "ATTEMPT", "STEP", "LOSS", "PLACEMENT", "CREATED", box=None)
    for j in items:
        step = "-" if j.get("last_step") is None else str(j["last_step"])
        table.add_row(
            j["id"],
            j["name"],
            _state(j["state"]),
            str(j["attempt"]),
            step,
            _loss(j.get("loss")),
            _nodes_of(j),
            j["created_at"][:19].replace("T", " "),
        )
    return table


def print_job(console: Console, job: dict[str, Any]) -> None:
    console.print(f"[bold]{job['id']}[/] {job['name']}  {_state(job['state'])}  attempt {job['attempt']}")
    step = "-" if job.get("last_step") is None else job["last_step"]
    console.print(f"  step {step}, loss {_loss(job.get('loss'))}, placement {_nodes_of(job)}")
    if job.get("tokens_per_s") is not None:
        mfu = "-" if job.get("mfu") is None else f"{100 * job['mfu']:.1f}%"
        console.print(f"  {job['tokens_per_s']:,.0f} tokens/s per rank, MFU {mfu}")
    if job.get("resume_from"):
        console.print(f"  resumes from {job['resume_from']}")
    owner = job.get("owner")
    if owner:
        console.print(f"  owner {owner}" + (f" (team {job['team']})" if job.get("team") else ""))
    if queued := job.get("queue"):
        start = queued["estimated_start"] or "unknown"
        console.print(f"  queue: position {queued['position']}, estimated start {start}")
        console.print(f"  waits: {queued['reason']}")
    elif job.get("queue_reason"):
        console.print(f"  waits: {job['queue_reason']}")
    if job.get("reason"):
        console.print(f"  reason: {job['reason']}")
    if len(job.get("attempts") or []) > 1:
        attempts = Table("ATTEMPT", "LAUNCHED", "PLACEMENT", "RESUMED FROM", "CODE", "ENDED BY", box=None)
        for a in job["attempts"]:
            started, code = a["launched_at"][11:19], (a.get("code") or "-")[:12]
            attempts.add_row(
                str(a["attempt"]), started, _nodes_of(a), a["resume_from"] or "-", code, a["ended"] or "-"
            )
        console.print(attempts)
    if job.get("transitions"):
        table = Table("WHEN", "ATTEMPT", "FROM", "TO", "CAUSE", box=None)
        for t in job["transitions"]:
            table.add_row(
                t["occurred_at"][11:23],
                str(t["attempt"]),
                t["from_state"] or "-",
                _state(t["to_state"]),
                t["cause"],
            )
        console.print(table)


def register(group: click.Group) -> None:
    @group.command("submit")
    @click.argument("file", type=click.Path(exists=True, dir_okay=False, path_type=Path))
    @click.option("--follow", is_flag=True, help="stream state changes and progress until the job ends")
    @click.option(
        "--idempotency-key",
        help="the submit's Idempotency-Key (default: a new random one; a cut-off submit is retried with it)",
    )
    @click.option(
        "--code",
        type=click.Path(exists=True, file_okay=False, path_type=Path),
        help="pack this folder (minus what .gitignore and .vigilignore exclude); the entrypoint runs a copy",
    )
    @url_option
    @json_option
    def submit(
        file: Path,
        follow: bool,
        idempotency_key: str | None,
        code: Path | None,
        url: str | None,
        json_out: bool,
    ) -> None:
        """Submit the job spec in FILE (YAML or JSON); with --code DIR, the program in DIR."""
        client = connect(url)
        job = client.submit(file, code=code, idempotency_key=idempotency_key)
        console = Console()
        if json_out:
            click.echo(as_json(job))
        else:
            console.print(f"submitted [bold]{job.id}[/] ({job.name}), {_state(job.state)}")
        if follow:
            final = follow_job(client, job.id, console, json_out)
            raise SystemExit(0 if final == JobState.SUCCEEDED else 1)

    @group.group("jobs", invoke_without_command=True)
    @click.option("--state", help="only jobs in this state")
    @click.option("--limit", type=int, default=50, show_default=True)
    @url_option
    @json_option
    @click.pass_context
    def jobs(ctx: click.Context, state: str | None, limit: int, url: str | None, json_out: bool) -> None:
        """List jobs, newest first (`vigil jobs code JOB`: the code package a job runs)."""
        if ctx.invoked_subcommand is not None:
            return
        page = connect(url).jobs(state, limit=limit)
        if json_out:
            click.echo(as_json(page))
        else:
            Console().print(jobs_table([j.model_dump(mode="json") for j in page.items]))

    code_command.register(jobs, url_option)

    @group.command("job")
    @click.argument("job_id")
    @url_option
    @json_option
    def job(job_id: str, url: str | None, json_out: bool) -> None:
        """One job: state, placement, attempts, progress and every transition with its cause."""
        data = connect(url).job(job_id)
        if json_out:
            click.echo(as_json(data))
        else:
            print_job(Console(), data.model_dump(mode="json"))

    @group.command("cancel")
    @click.argument("job_id")
    @url_option
    @json_option
    def cancel(job_id: str, url: str | None, json_out: bool) -> None:
        """Cancel a queued or running job."""
        data = connect(url).cancel(job_id)
        if json_out:
            click.echo(as_json(data))
        else:
            Console().print(f"{data.id} {_state(data.state)}")

    @group.command("nodes")
    @url_option
    @json_option
    def nodes(url: str | None, json_out: bool) -> None:
        """Nodes: liveness, last heartbeat, devices in use and unhealthy."""
        nodes_page = connect(url).nodes()
        if json_out:
            click.echo(as_json(nodes_page))
            return
        page = nodes_page.model_dump(mode="json")
        table = Table(
            "NAME", "ADDRESS", "ALIVE", "LAST HEARTBEAT", "DEVICES", "IN USE", "UNHEALTHY", box=None
        )
        for n in page["items"]:
            devices = n["devices"]
            table.add_row(
                n["name"] + (" (spare)" if n.get("spare") else ""), n["address"],
                "[green]yes[/]" if n["alive"] else "[red]lost[/]",
                n["last_heartbeat"][:19].replace("T", " "), str(len(devices)),
                str(sum(d["job_id"] is not None for d in devices)),
                ", ".join(str(d["index"]) for d in devices if not d["healthy"]) or "-",
            )  # fmt: skip
        Console().print(table)

    @group.command("status")
    @url_option
    @json_option
    def status(url: str | None, json_out: bool) -> None:
        """The control plane: the active scheduler (others stand by and take over within VIGIL_TAKEOVER_S)
        and each guardian with the shares of the jobs it judges (a gone one's are taken within it)."""
        plane = connect(url).control_plane()
        if json_out:
            click.echo(as_json(plane))
            return
        table = Table("ROLE", "ACTIVE INSTANCE", "ADDRESS", "SINCE", "SHARES", box=None)
        for role in ("scheduler", "guardian"):
            held = [h for h in plane.active if h.role == role]
            for h in held:
                since = h.since.isoformat()[:19].replace("T", " ")
                shares = (_ranges(h.shares) or "none yet") if role == "guardian" else "-"
                table.add_row(role, h.instance, h.address or "local", since, shares)
            if not held:
                table.add_row(role, "[red]none[/]", "-", "-")
        Console().print(table)

    @group.command("gpus")
    @click.option(
        "--clear",
        "clear",
        metavar="NODE:DEVICE",
        default=None,
        help="clear that device's unhealthy mark (admin token; audited): placement offers it again",
    )
    @url_option
    @json_option
    def gpus(clear: str | None, url: str | None, json_out: bool) -> None:
        """Devices: health (and why a device is marked unhealthy, until when), owner job and latest sample."""
        if clear is not None:
            node, index = _device_ref(clear)
            cleared = connect(url).clear_device_mark(node, index)
            if json_out:
                click.echo(as_json(cleared))
            else:
                was = cleared.cleared
                Console().print(f"{node}:{index} mark cleared (was {was['source']}: {was['reason']})")
            return
        gpus_page = connect(url).gpus()
        if json_out:
            click.echo(as_json(gpus_page))
            return
        page = gpus_page.model_dump(mode="json")
        table = Table("NODE", "IDX", "KIND", "NAME", "HEALTH", "JOB", "UTIL %", "MEM", "TEMP", box=None)
        for g in page["items"]:
            s = g.get("latest") or {}
            util = s.get("utilization_pct")
            mem = s.get("memory_used_bytes")
            temp = s.get("temperature_c")
            expires = g.get("mark_expires_at")  # a job's replays' mark lapses; a confirmed one does not
            until = f" (until {expires[:19].replace('T', ' ')})" if expires else ""
            why = g.get("unhealthy_reason") or "unhealthy"
            table.add_row(
                g["node"], str(g["index"]), g["kind"], g["name"],
                "[green]ok[/]" if g["healthy"] else f"[red]{why}[/]{until}",
                g["job_id"] or "-", "-" if util is None else f"{util:.0f}",
                "-" if mem is None else f"{mem / 2**30:.1f} GiB", "-" if temp is None else f"{temp:.0f} C",
            )  # fmt: skip
        Console().print(table)


def _device_ref(text: str) -> tuple[str, int]:
    """`NODE:DEVICE` -> (node, device index); a UsageError naming the value otherwise."""
    node, sep, index = text.rpartition(":")
    if not sep or not node or not index.isdigit():
        raise click.UsageError(
            f"--clear {text!r}: expected NODE:DEVICE, a node name and a device index (n1:0)"
        )
    return node, int(index)


def follow_job(client: Client, job_id: str, console: Console, json_out: bool) -> str:
    """Print the job's state changes and incidents (the gateway's live events) and its progress until
    it ends; the final state."""
    done, ending_shown = threading.Event(), threading.Event()

    def progress() -> None:
        last: tuple[Any, ...] = ()
        while not done.wait(2.0):
            with contextlib.suppress(VigilError):  # best effort
                job = client.job(job_id)
                now = (job.state, job.last_step, job.loss)
                if now != last and job.last_step is not None and not json_out:
                    console.print(f"  step {job.last_step}  loss {_loss(job.loss)}")
                last = now

    def show(event: Event) -> None:
        if isinstance(event, JobStateChanged) and event.to_state in TERMINAL_STATES:
            ending_shown.set()
        if json_out:
            click.echo(event.model_dump_json())
        elif isinstance(event, JobStateChanged):
            console.print(f"{_state(event.to_state)} (attempt {event.attempt}): {event.cause}")
        else:
            console.print(f"[bold red]incident[/] {event.kind} -> {event.action}: {event.message}")

    ticker = threading.Thread(target=progress, daemon=True)
    ticker.start()
    try:
        final = client.wait(job_id, on_event=show)
    finally:
        done.set()
    if final.transitions and not ending_shown.is_set():  # it ended before we listened: say how
        last = final.transitions[-1]
        if json_out:
            click.echo(last.model_dump_json())
        else:
            console.print(f"{_state(last.to_state)} (attempt {last.attempt}): {last.cause}")
    return str(final.state)


def _ranges(values: list[int]) -> str:
    """`[0, 1, 2, 5, 7, 8]` -> `0-2, 5, 7-8`."""
    out: list[str] = []
    for v in sorted(values):
        if out and out[-1].split("-")[-1] == str(v - 1):
            out[-1] = f"{out[-1].split('-')[0]}-{v}"
        else:
            out.append(str(v))
    return ", ".join(out)
