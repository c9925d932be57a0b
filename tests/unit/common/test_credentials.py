"""credentials.py: each role's NATS permissions. A role creates, reads, pulls from, acknowledges and
deletes only the consumers it owns, and every consumer a service uses is one its role owns; no role
reads or publishes into another's inbox, or answers requests."""

from __future__ import annotations

import re
from pathlib import Path
from types import ModuleType

import pytest

from vigil_common import credentials, subjects
from vigil_common.bus import ConsumerSpec
from vigil_guardian import service as guardian_service
from vigil_scheduler import main as scheduler_main
from vigil_telemetry import main as telemetry_main
from vigil_worker import consumers as worker_consumers

ROOT = Path(__file__).resolve().parents[3]
NODES = ("n1", "gpu-a")
ROLES = credentials.roles(NODES)
SERVICES: dict[str, ModuleType] = {
    credentials.SCHEDULER: scheduler_main,
    credentials.GUARDIAN: guardian_service,
    credentials.TELEMETRY: telemetry_main,
}


def specs_of(module: ModuleType) -> list[ConsumerSpec]:
    return [value for value in vars(module).values() if isinstance(value, ConsumerSpec)]


def used_by(role: str) -> set[tuple[str, str]]:
    """(stream, consumer) of every ConsumerSpec the role's service uses, and its scans."""
    if role.startswith("worker-"):
        specs = list(worker_consumers.consumers(role.removeprefix("worker-")))
    else:
        specs = specs_of(SERVICES[role])
    used = {(s.stream.name, s.durable) for s in specs}
    if role == credentials.GUARDIAN:
        used |= {(s.stream.name, s.durable) for s in guardian_service.INPUTS}  # one per share
        for k in range(subjects.SHARES):  # Bus.scan at a share's restore: its jobs' ends, their steps
            used.add((subjects.JOBS.name, credentials.guardian_scan(k)))
        used |= set(credentials.LEGACY_GUARDIAN)  # deleted at start
    return used


@pytest.mark.parametrize("role", [r for r in ROLES if r != credentials.ADMIN])
def test_every_consumer_a_service_uses_is_one_its_role_owns(role: str) -> None:
    assert used_by(role) == set(credentials.consumers(role))


def test_consumer_specs_are_declared_where_this_test_looks() -> None:
    """A ConsumerSpec made in another module would escape the check above: add that module there."""
    checked = {
        ROOT / "services/scheduler/vigil_scheduler/main.py",
        ROOT / "services/guardian/vigil_guardian/service.py",
        ROOT / "services/telemetry/vigil_telemetry/main.py",
        ROOT / "services/worker/vigil_worker/consumers.py",
    }
    found = {path for path in (ROOT / "services").rglob("*.py") if "ConsumerSpec(" in path.read_text()}
    assert found <= checked, sorted(map(str, found - checked))


def test_no_two_roles_own_a_consumer() -> None:
    owners: dict[tuple[str, str], str] = {}
    for role in ROLES:
        for consumer in credentials.consumers(role):
            assert consumer not in owners, f"{consumer} owned by {owners[consumer]} and {role}"
            owners[consumer] = role


def allowed(role: str, kind: str) -> list[str]:
    granted = credentials.permissions(role)
    return list(granted[kind]["allow"])  # type: ignore[index]


def consumer_named(subject: str) -> tuple[str, list[str]] | None:
    """(stream, consumer) and what follows them, of a consumer API or ack subject; None for others."""
    parts = subject.split(".")
    if parts[:2] == ["$JS", "ACK"]:
        at = 2  # $JS.ACK.<stream>.<consumer>.>
    elif parts[:5] == ["$JS", "API", "CONSUMER", "MSG", "NEXT"]:
        at = 5  # $JS.API.CONSUMER.MSG.NEXT.<stream>.<consumer>
    elif parts[:3] == ["$JS", "API", "CONSUMER"]:
        at = 4  # $JS.API.CONSUMER.<CREATE|INFO|DELETE|...>.<stream>.<consumer>[.<filter>]
    else:
        return None
    return ".".join(parts[at : at + 2]), parts[at + 2 :]


@pytest.mark.parametrize("role", [r for r in ROLES if r != credentials.ADMIN])
def test_a_role_touches_only_its_own_consumers_by_name(role: str) -> None:
    owned = {f"{stream}.{name}" for stream, name in credentials.consumers(role)}
    for subject in allowed(role, "publish"):
        if (named := consumer_named(subject)) is None:
            continue
        consumer, rest = named
        # never a consumer without a name (a create whose body could carry any name), nor a wildcard
        assert consumer in owned, f"{role} may use {subject}"
        assert rest in ([], [">"]), f"{role} may use {subject}"
    for stream, name in credentials.consumers(role):
        assert f"$JS.API.CONSUMER.CREATE.{stream}.{name}.>" in allowed(role, "publish")
        assert f"$JS.API.CONSUMER.DELETE.{stream}.{name}" in allowed(role, "publish")


@pytest.mark.parametrize("role", [r for r in ROLES if r != credentials.ADMIN])
def test_a_role_reads_only_its_own_inbox_and_what_it_watches(role: str) -> None:
    granted = credentials.permissions(role)
    if role.startswith("worker-"):  # its node's ping, and nothing else: one reply per request it heard
        assert granted["allow_responses"] == {"max": 1, "expires": "5s"}
        assert credentials.listened(role) == (subjects.ping(role.removeprefix("worker-")),)
    else:
        assert "allow_responses" not in granted
    assert subjects.ping("n1") not in credentials.listened(credentials.SCHEDULER)
    prefix = credentials.inbox_prefix(role)
    assert prefix == f"_INBOX_{role}"
    assert allowed(role, "subscribe") == [
        f"{prefix}.>",
        *credentials.watched(role),
        *credentials.listened(role),
    ]
    for subject in allowed(role, "publish"):
        assert not subject.startswith("_INBOX"), f"{role} publishes into an inbox: {subject}"
        assert not re.match(r"^(>|\$JS\.>|\$JS\.API\.>)", subject), subject
        assert "STREAM.DELETE" not in subject
        # the one purge: the scheduler's, of one code package's chunks in the code bucket's stream
        assert "STREAM.PURGE" not in subject or (
            role == credentials.SCHEDULER and subject == f"$JS.API.STREAM.PURGE.{subjects.CODE.stream}"
        )
    for other in ROLES:  # no role's inbox is inside another's
        if other != role:
            assert not subjects.matches(f"{prefix}.>", f"{credentials.inbox_prefix(other)}.x")


def test_only_the_scheduler_publishes_on_the_control_planes_status() -> None:
    control = subjects.status("j1", subjects.CONTROL)
    for role in ROLES:
        may = any(subjects.matches(s, control) for s in allowed(role, "publish"))
        assert may == (role in (credentials.ADMIN, credentials.SCHEDULER)), role


def test_a_worker_publishes_step_and_status_only_on_its_own_nodes_subjects() -> None:
    publish = allowed(credentials.worker_role("n1"), "publish")
    for subject in (subjects.step("j1", "n1"), subjects.status("j1", "n1"), subjects.heartbeat("n1")):
        assert any(subjects.matches(s, subject) for s in publish), subject
    for subject in (
        subjects.step("j1", "n2"),
        subjects.status("j1", "n2"),
        subjects.status("j1", subjects.CONTROL),
        subjects.cmd("j1"),
        subjects.launch("j1"),
        subjects.heartbeat("n2"),
    ):
        assert not any(subjects.matches(s, subject) for s in publish), subject


def test_inbox_prefixes() -> None:
    assert credentials.inbox_prefix(credentials.GUARDIAN) == "_INBOX_guardian"
    assert credentials.inbox_prefix(credentials.worker_role("gpu-a")) == "_INBOX_worker-gpu-a"
    assert credentials.inbox_prefix(credentials.worker_role("n" * 64)) == "_INBOX_worker-" + "n" * 64
    # anonymous, or a user that is none of Vigil's roles: NATS's own
    for user in (None, "alice", "worker-", "a.b", "someone@example.com"):
        assert credentials.inbox_prefix(user) == "_INBOX"


def test_worker_consumers_are_named_after_the_node() -> None:
    assert credentials.worker_consumers("n1") == ("worker-n1-launches", "worker-n1-commands")
    with pytest.raises(ValueError, match="node name"):
        credentials.worker_consumers("a.b")
