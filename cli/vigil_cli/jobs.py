"""The gateway's clients: `submit [--follow]`, `jobs`, `job ID`, `cancel ID`, `nodes`, `gpus`; rich
tables for people, `--json` for scripts.

The clients talk HTTP to the gateway at VIGIL_HTTP_HOST:VIGIL_HTTP_PORT (or `--url`) with the bearer
token from VIGIL_API_TOKEN, else the token file `vigil up` writes in the data dir.
"""

from __future__ import annotations

import contextlib
import json
import threading
from pathlib import Path
from typing import Any

import click
import httpx
from rich.console import Console
from rich.table import Table

from vigil_common.jobstates import TERMINAL_STATES, JobState
from vigil_common.settings import Settings
from vigil_common.token import require_token

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
json_option = click.option("--json", "as_json", is_flag=True, help="print JSON instead of a table")


class Gateway:
    """A small synchronous client of the HTTP API; errors become click errors naming the problem."""

    def __init__(self, url: str | None) -> None:
        settings = Settings.load()
        self.base = (url or f"http://{settings.http_host}:{settings.http_port}").rstrip("/")
        self.token = require_token(settings)
        self.http = httpx.Client(
            base_url=self.base, headers={"Authorization": f"Bearer {self.token}"}, timeout=30
        )

    def request(self, method: str, path: str, **kw: Any) -> Any:
        try:
            r = self.http.request(method, path, **kw)
        except httpx.TransportError as exc:
            raise click.ClickException(
                f"cannot reach the gateway at {self.base} ({exc}): is `vigil up` running?"
            ) from exc
        if r.status_code >= 400:
            raise click.ClickException(describe_error(r))
        return r.json()


def describe_error(r: httpx.Response) -> str:
    try:
        body = r.json()
    except ValueError:
        return f"HTTP {r.status_code}: {r.text[:500]}"
    lines = [f"HTTP {r.status_code}: {body.get('message', body)}"]
    lines += [f"  {f['field']}: {f['message']}" for f in body.get("fields", [])]
    return "\n".join(lines)


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
    if job.get("reason"):
        console.print(f"  reason: {job['reason']}")
    if len(job.get("attempts") or []) > 1:
        attempts = Table("ATTEMPT", "LAUNCHED", "PLACEMENT", "RESUMED FROM", "ENDED BY", box=None)
        for a in job["attempts"]:
            started = a["launched_at"][11:19]
            attempts.add_row(
                str(a["attempt"]), started, _nodes_of(a), a["resume_from"] or "-", a["ended"] or "-"
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
    @url_option
    @json_option
    def submit(file: Path, follow: bool, url: str | None, as_json: bool) -> None:
        """Submit the job spec in FILE (YAML or JSON)."""
        gw = Gateway(url)
        kind = "application/json" if file.suffix.lower() == ".json" else "application/yaml"
        job = gw.request("POST", "/api/v1/jobs", content=file.read_bytes(), headers={"Content-Type": kind})
        console = Console()
        if as_json:
            click.echo(json.dumps(job))
        else:
            console.print(f"submitted [bold]{job['id']}[/] ({job['name']}), {_state(job['state'])}")
        if follow:
            final = follow_job(gw, job["id"], console, as_json)
            raise SystemExit(0 if final == JobState.SUCCEEDED else 1)

    @group.command("jobs")
    @click.option("--state", help="only jobs in this state")
    @click.option("--limit", type=int, default=50, show_default=True)
    @url_option
    @json_option
    def jobs(state: str | None, limit: int, url: str | None, as_json: bool) -> None:
        """List jobs, newest first."""
        params: dict[str, Any] = {"limit": limit}
        if state:
            params["state"] = state.upper()
        page = Gateway(url).request("GET", "/api/v1/jobs", params=params)
        if as_json:
            click.echo(json.dumps(page))
        else:
            Console().print(jobs_table(page["items"]))

    @group.command("job")
    @click.argument("job_id")
    @url_option
    @json_option
    def job(job_id: str, url: str | None, as_json: bool) -> None:
        """One job: state, placement, attempts, progress and every transition with its cause."""
        data = Gateway(url).request("GET", f"/api/v1/jobs/{job_id}")
        if as_json:
            click.echo(json.dumps(data))
        else:
            print_job(Console(), data)

    @group.command("cancel")
    @click.argument("job_id")
    @url_option
    @json_option
    def cancel(job_id: str, url: str | None, as_json: bool) -> None:
        """Cancel a queued or running job."""
        data = Gateway(url).request("POST", f"/api/v1/jobs/{job_id}/cancel")
        if as_json:
            click.echo(json.dumps(data))
        else:
            Console().print(f"{data['id']} {_state(data['state'])}")

    @group.command("nodes")
    @url_option
    @json_option
    def nodes(url: str | None, as_json: bool) -> None:
        """Nodes: liveness, last heartbeat, devices in use and unhealthy."""
        page = Gateway(url).request("GET", "/api/v1/nodes", params={"limit": 1000})
        if as_json:
            click.echo(json.dumps(page))
            return
        table = Table(
            "NAME", "ADDRESS", "ALIVE", "LAST HEARTBEAT", "DEVICES", "IN USE", "UNHEALTHY", box=None
        )
        for n in page["items"]:
            devices = n["devices"]
            table.add_row(
                n["name"], n["address"], "[green]yes[/]" if n["alive"] else "[red]lost[/]",
                n["last_heartbeat"][:19].replace("T", " "), str(len(devices)),
                str(sum(d["job_id"] is not None for d in devices)),
                ", ".join(str(d["index"]) for d in devices if not d["healthy"]) or "-",
            )  # fmt: skip
        Console().print(table)

    @group.command("gpus")
    @url_option
    @json_option
    def gpus(url: str | None, as_json: bool) -> None:
        """Devices: health, owner job and latest sample."""
        page = Gateway(url).request("GET", "/api/v1/gpus", params={"limit": 1000})
        if as_json:
            click.echo(json.dumps(page))
            return
        table = Table("NODE", "IDX", "KIND", "NAME", "HEALTH", "JOB", "UTIL %", "MEM", "TEMP", box=None)
        for g in page["items"]:
            s = g.get("latest") or {}
            util = s.get("utilization_pct")
            mem = s.get("memory_used_bytes")
            temp = s.get("temperature_c")
            table.add_row(
                g["node"], str(g["index"]), g["kind"], g["name"],
                "[green]ok[/]" if g["healthy"] else f"[red]{g.get('unhealthy_reason') or 'unhealthy'}[/]",
                g["job_id"] or "-", "-" if util is None else f"{util:.0f}",
                "-" if mem is None else f"{mem / 2**30:.1f} GiB", "-" if temp is None else f"{temp:.0f} C",
            )  # fmt: skip
        Console().print(table)


def follow_job(gw: Gateway, job_id: str, console: Console, as_json: bool) -> str:
    """Print the job's state changes and incidents (server-sent events) and its progress until it ends."""
    done = threading.Event()

    def progress() -> None:
        last: tuple[Any, ...] = ()
        while not done.wait(2.0):
            with contextlib.suppress(click.ClickException, httpx.HTTPError):  # best effort
                job = gw.request("GET", f"/api/v1/jobs/{job_id}")
                now = (job["state"], job.get("last_step"), job.get("loss"))
                if now != last and job.get("last_step") is not None and not as_json:
                    console.print(f"  step {job['last_step']}  loss {_loss(job.get('loss'))}")
                last = now

    ticker = threading.Thread(target=progress, daemon=True)
    ticker.start()
    try:
        with gw.http.stream("GET", "/api/v1/events", params={"job": job_id}, timeout=None) as r:
            if r.status_code >= 400:
                r.read()
                raise click.ClickException(describe_error(r))
            kind = None
            for line in r.iter_lines():
                if line.startswith(": connected"):  # subscribed: a change from now on reaches us
                    current = gw.request("GET", f"/api/v1/jobs/{job_id}")
                    if current["state"] in TERMINAL_STATES:  # it ended before we listened
                        last = current["transitions"][-1]
                        if as_json:
                            click.echo(json.dumps(last))
                        else:
                            console.print(
                                f"{_state(last['to_state'])} (attempt {last['attempt']}): {last['cause']}"
                            )
                        return str(current["state"])
                elif line.startswith("event: "):
                    kind = line.removeprefix("event: ")
                elif line.startswith("data: ") and kind:
                    event = json.loads(line.removeprefix("data: "))
                    if as_json:
                        click.echo(json.dumps(event))
                    elif kind == "job.state_changed":
                        console.print(
                            f"{_state(event['to_state'])} (attempt {event['attempt']}): {event['cause']}"
                        )
                    else:
                        console.print(
                            f"[bold red]incident[/] {event['kind']} -> {event['action']}: {event['message']}"
                        )
                    if kind == "job.state_changed" and event["to_state"] in TERMINAL_STATES:
                        return event["to_state"]
        raise click.ClickException(f"the event stream from {gw.base} ended before job {job_id} did")
    except httpx.TransportError as exc:
        raise click.ClickException(f"lost the event stream from {gw.base}: {exc}") from exc
    finally:
        done.set()
