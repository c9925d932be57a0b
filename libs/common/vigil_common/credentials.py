"""Least privilege on the bus: one NATS user per role, with the subjects it may publish and read.

Roles (what the NATS server enforces, statically, from the `authorization` block built here):

| role | publishes | cannot |
| --- | --- | --- |
| `scheduler` | launch, `_control` status, cmd, incidents, pings, code; makes streams | node step/status |
| `guardian` | cmd, incidents | launch, status, step, node events |
| `telemetry` | nothing but dead letters (read only) | any event, any command |
| `worker-<node>` | its heartbeat, gpu, any job's step/status; answers its ping | cmd, launch, incidents |
| `admin` | everything (`vigil up` itself, the CLI, benches) | |

Code packages (`subjects.CODE`, an Object Store bucket): the scheduler puts, reads and deletes them, a
worker reads them (`buckets_read`, `buckets_written`).

JetStream: every role reads stream state, never changes, deletes or purges a stream (the scheduler
creates and updates them). A role creates, updates, reads, pulls from, acknowledges and deletes only
the consumers it owns (`consumers(role)`), by name: the name is in the create request's subject, and a
request without a name (whose body could carry any name) is refused. A role subscribes only below its
own inbox prefix (`inbox_prefix`: its deliveries and API replies) and to the subjects it watches
(`watched`), answers no request (no `allow_responses`; a worker answers its own node's ping, one reply
per request) and publishes into no other inbox, so nobody reads
another role's deliveries or pushes into them. A delivery that names another consumer in its ack
subject (a pull request's reply set to someone else's inbox) is dropped by the bus (`Bus._foreign`).

What the server cannot enforce from a static file, and the processes do: which jobs are placed on a
node changes at run time. A worker may publish any job's step and status events, but only on its own
node's subjects; the receivers check each one against the placement of the job's launch
(`vigil_common.origin`), so a worker speaks only for the ranks it launched. Ranks talk to their own
worker agent only (`vigil_worker.relay`), which publishes for them.
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
# Postgres: the role and database the services use (owner of its schema; no superuser, no server files
# or programs); `postgres`, the superuser, only sets the embedded server up.
APP_ROLE = APP_DATABASE = "vigil"
SERVICE_ROLES = (SCHEDULER, GUARDIAN, TELEMETRY)
CREDENTIALS_FILE = "credentials.json"
_VARIABLE = re.compile(r"^[A-Z_][A-Z0-9_]*$")
_ROLE = re.compile(r"^[A-Za-z0-9_-]+$")  # one subject token: a role names its inbox prefix

# What every role may ask JetStream: account and stream state (never a stream's change or deletion).
_JS_READ = ("$JS.API.INFO", "$JS.API.STREAM.INFO.*", "$JS.API.STREAM.NAMES")
_STREAM_ADMIN = ("$JS.API.STREAM.CREATE.*", "$JS.API.STREAM.UPDATE.*")


def guardian_input(share: int) -> str:
    """The durable consumer of one guardian share (VIGIL_JOBS, filtered on the share's stored subjects)."""
    return f"guardian-{subjects.check_share(share)}"


def guardian_scan(share: int) -> str:
    """The named pull consumer a share's guardian reads stored events back with at start (`Bus.scan`)."""
    return f"guardian-scan-{subjects.check_share(share)}"


LEGACY_GUARDIAN = ((subjects.JOBS.name, "guardian"), (subjects.NODES.name, "guardian-gpu"))


def worker_role(node: str) -> str:
    return f"worker-{subjects.node_token(node)}"


def worker_consumers(node: str) -> tuple[str, str]:
    """A worker's durable consumers: its launches (VIGIL_JOBS) and its commands (VIGIL_COMMANDS)."""
    role = worker_role(node)
    return f"{role}-launches", f"{role}-commands"


def consumers(role: str) -> tuple[tuple[str, str], ...]:
    """The consumers `role` owns, as (stream, consumer name): the only ones it may create, update, read
    the state of, pull from, acknowledge and delete. A service's ConsumerSpecs name exactly these
    (tests/unit/common/test_credentials.py)."""
    jobs, nodes, cmds, incidents = (
        s.name for s in (subjects.JOBS, subjects.NODES, subjects.COMMANDS, subjects.INCIDENTS)
    )
    if role == SCHEDULER:
        return (
            (nodes, "scheduler-heartbeats"),
            (jobs, "scheduler-status"),
            (cmds, "scheduler-commands"),
            (incidents, "scheduler-incidents"),
        )
    if role == GUARDIAN:
        per_share = [(jobs, f(k)) for k in range(subjects.SHARES) for f in (guardian_input, guardian_scan)]
        # the consumers of the guardian before shares (one input, one GPU consumer): it deletes them
        return (*per_share, *LEGACY_GUARDIAN)
    if role == TELEMETRY:
        return (
            (jobs, "telemetry-steps"),
            (jobs, "telemetry-status"),
            (jobs, "telemetry-launches"),
            (nodes, "telemetry-gpu"),
            (incidents, "telemetry-incidents"),
            (incidents, "telemetry-alerts"),
        )
    if role.startswith("worker-"):
        launches, commands = worker_consumers(role.removeprefix("worker-"))
        return ((jobs, launches), (cmds, commands))
    return ()


def listened(role: str) -> tuple[str, ...]:
    """The subjects `role` hears as they are published (`Bus.listen`, a core subscription, nothing
    stored is read): every guardian hears every GPU sample; a worker, its node's pings."""
    if role == GUARDIAN:
        return (subjects.ALL_GPU,)
    if role.startswith("worker-"):
        return (subjects.ping(role.removeprefix("worker-")),)
    return ()


def watched(role: str) -> tuple[str, ...]:
    """The subjects `role` follows with `Bus.watch` (read from their stream with STREAM.MSG.GET, woken by
    a core subscription): the gateway's and console's live events, the commands a worker feeds its ranks."""
    if role == SCHEDULER:
        return (subjects.ALL_STATUS, subjects.ALL_STEPS, subjects.ALL_INCIDENTS)
    if role.startswith("worker-"):
        return (subjects.ALL_CMDS,)
    return ()


def buckets_read(role: str) -> tuple[subjects.BucketSpec, ...]:
    """The Object Store buckets `role` reads (object by object, `Bus.get_object`): the scheduler (the
    gateway's downloads) and every worker (the code packages of the jobs it runs) read code packages."""
    return (subjects.CODE,) if role == SCHEDULER or _is_worker(role) else ()


def buckets_written(role: str) -> tuple[str, ...]:
    """What `role` publishes to put and delete objects: the scheduler, code packages (the gateway's
    uploads, the sweep's deletions): their chunks and metadata, and the purge of one object's chunks in
    the bucket's own stream (no other stream's)."""
    if role != SCHEDULER:
        return ()
    return (subjects.CODE.all_subjects, f"$JS.API.STREAM.PURGE.{subjects.CODE.stream}")


def inbox_prefix(user: str | None) -> str:
    """The inbox prefix of a connection as `user` (`Bus.connect`): `_INBOX_<role>` for one of Vigil's
    roles, which only that role may subscribe below (no other credential reads its JetStream deliveries
    and API replies, nor publishes into them); NATS's `_INBOX` for anyone else, and without a user."""
    if user is None or not _ROLE.match(user) or not (user in (ADMIN, *SERVICE_ROLES) or _is_worker(user)):
        return "_INBOX"
    return f"_INBOX_{user}"


def _is_worker(role: str) -> bool:
    return role.startswith("worker-") and len(role) > len("worker-")


def permissions(role: str) -> dict[str, object]:
    """The NATS `permissions` block of a role: publish and subscribe allow lists (all else denied).

    No role but admin answers requests (no `allow_responses`; a worker answers its node's ping), creates
    a consumer without a name (a nameless create may carry any name in its body and so replace another's
    consumer), or subscribes outside its own inbox and the subjects it watches."""
    if role == ADMIN:
        return {"publish": {"allow": [">"]}, "subscribe": {"allow": [">"]}}
    publish: tuple[str, ...]
    if role == SCHEDULER:
        publish = (
            subjects.ALL_LAUNCHES,
            subjects.CONTROL_STATUS,
            subjects.ALL_CMDS,
            subjects.ALL_INCIDENTS,
            subjects.ALL_PINGS,
            *_STREAM_ADMIN,
        )
    elif role == GUARDIAN:
        publish = (subjects.ALL_CMDS, subjects.ALL_INCIDENTS)
    elif role == TELEMETRY:
        publish = ()
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
    owned: list[str] = []
    for stream, name in consumers(role):
        owned += [
            f"$JS.API.CONSUMER.CREATE.{stream}.{name}",
            f"$JS.API.CONSUMER.CREATE.{stream}.{name}.>",  # the name, then its filter subject
            f"$JS.API.CONSUMER.INFO.{stream}.{name}",
            f"$JS.API.CONSUMER.MSG.NEXT.{stream}.{name}",
            f"$JS.API.CONSUMER.DELETE.{stream}.{name}",
            f"$JS.ACK.{stream}.{name}.>",
        ]
    dead_letters = (subjects.ALL_DEAD_LETTERS,) if owned else ()  # what its consumers terminate
    publish = (*publish, *buckets_written(role))
    watches = watched(role)
    # Stored messages it reads one by one: what it watches, and the launches its origin checks read.
    streams = {subjects.stream_for(s).name for s in watches}
    if role in SERVICE_ROLES:
        streams.add(subjects.JOBS.name)
    streams.update(bucket.stream for bucket in buckets_read(role))
    reads = [f"$JS.API.STREAM.MSG.GET.{name}" for name in sorted(streams)]
    granted: dict[str, object] = {
        "publish": {"allow": [*publish, *dead_letters, *_JS_READ, *reads, *owned]},
        "subscribe": {"allow": [f"{inbox_prefix(role)}.>", *watches, *listened(role)]},
    }
    if role.startswith("worker-"):  # its ping's one reply, to the asker's inbox, within 5 s
        granted["allow_responses"] = {"max": 1, "expires": "5s"}
    return granted


def command_publishers() -> tuple[str, ...]:
    """The roles the server lets publish a command (`subjects.ALL_CMDS`): what an audited command's
    actor can be (`vigil_scheduler.audit`)."""
    return (ADMIN, *(r for r in SERVICE_ROLES if subjects.ALL_CMDS in permissions(r)["publish"]["allow"]))  # type: ignore[index]


def roles(nodes: Iterable[str] = ()) -> list[str]:
    return [ADMIN, *SERVICE_ROLES, *(worker_role(n) for n in nodes)]


@dataclass
class Credentials:
    """Generated passwords: one per NATS role, Postgres's superuser password (used only to set the
    server up) and the password of the application's role (`APP_ROLE`, what the services log in as)."""

    nats: dict[str, str] = field(default_factory=dict)
    postgres: str = ""
    postgres_app: str = ""

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
        creds = Credentials(
            nats=dict(found.get("nats", {})),
            postgres=found.get("postgres", ""),
            postgres_app=found.get("postgres_app", ""),
        )
    changed = creds.add_roles(roles(nodes))
    if not creds.postgres:
        creds.postgres, changed = secrets.token_urlsafe(24), True
    if not creds.postgres_app:
        creds.postgres_app, changed = secrets.token_urlsafe(24), True
    if changed or not path.exists():
        save(path, creds)
    return creds


def save(path: Path, creds: Credentials) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as out:
        json.dump({"nats": creds.nats, "postgres": creds.postgres, "postgres_app": creds.postgres_app}, out)
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
