"""Least privilege on the bus: one NATS user per role, with the subjects it may publish and read.

Roles (what the NATS server enforces, statically, from the `authorization` block built here):

| role | publishes | cannot |
| --- | --- | --- |
| `scheduler` | launch, status, cmd, incidents; creates and updates the streams | |
| `guardian` | cmd, incidents | launch, status, step, node events |
| `telemetry` | nothing but dead letters (read only) | any event, any command |
| `worker-<node>` | its node's heartbeat, gpu; any job's step, status | cmd, launch, incidents, other nodes' |
| `rank` | step and status of any job | cmd, launch, incidents, node events |
| `admin` | everything (`vigil up` itself, the CLI, benches) | |

Every role may use the JetStream API it needs to consume (consumer create/info, acks, flow control,
its `_INBOX` replies), never delete or purge a stream, and publish dead letters. No role but the
scheduler and admin may publish into `_INBOX.>` except as replies, so nobody forges a delivery to
another client's consumer.

What the server cannot enforce from a static file, and the processes do: which jobs are placed on a
worker changes at run time, so "a worker publishes only its own jobs' step/status events and reads
only their commands" and "ranks publish only their job's events" are enforced by the worker (it
creates command consumers for jobs launched on it, and hands each rank its job id) and by the ranks
(`trainer.telemetry` accepts commands only from the command stream, for its job). A leaked rank or
worker credential can therefore forge step/status events of another job, but never a command,
launch or incident.
"""

from __future__ import annotations

import json
import os
import re
import secrets
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import quote, urlsplit, urlunsplit

from vigil_common import subjects

ADMIN = "admin"
SCHEDULER = "scheduler"
GUARDIAN = "guardian"
TELEMETRY = "telemetry"
RANK = "rank"
SERVICE_ROLES = (SCHEDULER, GUARDIAN, TELEMETRY)
CREDENTIALS_FILE = "credentials.json"
_VARIABLE = re.compile(r"^[A-Z_][A-Z0-9_]*$")

# What every JetStream client needs to consume, read stream state and answer flow control.
_JS_CLIENT = (
    "$JS.API.INFO",
    "$JS.API.STREAM.INFO.*",
    "$JS.API.STREAM.NAMES",
    "$JS.API.CONSUMER.INFO.*.*",
    "$JS.API.CONSUMER.CREATE.*",
    "$JS.API.CONSUMER.CREATE.*.>",
    "$JS.API.CONSUMER.DURABLE.CREATE.*.*",
    "$JS.API.CONSUMER.MSG.NEXT.*.*",
    "$JS.ACK.>",
    "$JS.FC.>",
    subjects.ALL_DEAD_LETTERS,
)
_STREAM_ADMIN = ("$JS.API.STREAM.CREATE.*", "$JS.API.STREAM.UPDATE.*")


def worker_role(node: str) -> str:
    return f"worker-{subjects.node_token(node)}"


def permissions(role: str) -> dict[str, object]:
    """The NATS `permissions` block of a role: publish and subscribe allow lists (all else denied).

    `allow_responses` lets a role answer requests sent to it (the reply subject only, once)."""
    if role == ADMIN:
        return {"publish": {"allow": [">"]}, "subscribe": {"allow": [">"]}}
    publish: tuple[str, ...]
    if role == SCHEDULER:
        publish = (
            subjects.ALL_LAUNCHES,
            subjects.CONTROL_STATUS,
            subjects.ALL_CMDS,
            subjects.ALL_INCIDENTS,
            *_STREAM_ADMIN,
        )
    elif role == GUARDIAN:
        publish = (subjects.ALL_CMDS, subjects.ALL_INCIDENTS)
    elif role == TELEMETRY:
        # its consumers are shared by its replicas; one made unshared before is replaced (Bus._push)
        publish = ("$JS.API.CONSUMER.DELETE.*.*",)
    elif role == RANK:
        publish = (subjects.ALL_STEPS, subjects.ALL_STATUS)
    elif role.startswith("worker-"):
        node = role.removeprefix("worker-")
        publish = (
            subjects.heartbeat(node),
            subjects.gpu(node),
            subjects.node_steps(node),
            subjects.node_status(node),
        )
    else:
        raise ValueError(f"unknown NATS role {role!r}")
    return {
        "publish": {"allow": [*publish, *_JS_CLIENT]},
        "subscribe": {"allow": ["_INBOX.>"]},
        "allow_responses": True,
    }


def roles(nodes: Iterable[str] = ()) -> list[str]:
    return [ADMIN, *SERVICE_ROLES, RANK, *(worker_role(n) for n in nodes)]


@dataclass
class Credentials:
    """Generated passwords: one per NATS role, and Postgres's superuser password."""

    nats: dict[str, str] = field(default_factory=dict)
    postgres: str = ""

    def add_roles(self, names: Iterable[str]) -> bool:
        """Passwords for roles not yet present; True when one was added."""
        added = False
        for name in names:
            if name not in self.nats:
                self.nats[name] = secrets.token_urlsafe(24)
                added = True
        return added

    def nats_url(self, url: str, role: str) -> str:
        """`url` with this role's user and password (a URL that already names a user is kept)."""
        return with_user(url, role, self.nats[role])


def with_user(url: str, user: str, password: str) -> str:
    """`url` naming `user` (and `password`, when not empty); a URL that already names a user is kept."""
    parts = urlsplit(url)
    if parts.username:
        return url
    userinfo = quote(user, safe="") + (f":{quote(password, safe='')}" if password else "")
    return urlunsplit(parts._replace(netloc=f"{userinfo}@{parts.netloc}"))


def load_or_create(path: Path, nodes: Iterable[str] = ()) -> Credentials:
    """The credentials kept in `path` (mode 0600), created or extended with the roles missing."""
    creds = Credentials()
    if path.exists():
        found = json.loads(path.read_text())
        creds = Credentials(nats=dict(found.get("nats", {})), postgres=found.get("postgres", ""))
    changed = creds.add_roles(roles(nodes))
    if not creds.postgres:
        creds.postgres, changed = secrets.token_urlsafe(24), True
    if changed or not path.exists():
        save(path, creds)
    return creds


def save(path: Path, creds: Credentials) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as out:
        json.dump({"nats": creds.nats, "postgres": creds.postgres}, out)
    os.chmod(tmp, 0o600)
    tmp.replace(path)


def authorization_block(users: Mapping[str, str]) -> str:
    """The nats-server `authorization { users [...] }` block for these users (role -> password).

    JSON is valid nats-server configuration syntax, so every string is written JSON-quoted."""
    entries = [
        {"user": role, "password": password, "permissions": permissions(role)}
        for role, password in sorted(users.items())
    ]
    return "authorization {\n  users: " + json.dumps(entries, indent=2) + "\n}\n"


def authorization_template(variables: Mapping[str, str]) -> str:
    """`authorization_block` with each password a `$NAME` (role -> variable name) that nats-server
    reads from its environment when it starts: the same users and permissions, and no secret, for a
    configuration that is checked in (compose.yaml's, deploy/k8s's)."""
    for name in variables.values():
        if not _VARIABLE.match(name):
            raise ValueError(f"{name!r} is no nats-server variable name: use A-Z, 0-9 and '_'")
    text = authorization_block({role: f"${name}" for role, name in variables.items()})
    for name in set(variables.values()):  # unquoted: a quoted "$NAME" is the literal string
        text = text.replace(f'"password": "${name}"', f'"password": ${name}')
    return text
