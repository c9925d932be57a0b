"""The deployments' NATS users, in a real nats-server: compose's deploy/nats/nats.conf (ports and store
moved to this machine) with its authorization.conf, and Kubernetes' nats-authorization ConfigMap, each
with test passwords in the environment. A worker's or a rank's command is refused and never stored;
the guardian's is stored; the scheduler creates the streams, as it does when deployed."""

from __future__ import annotations

import subprocess
import uuid
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path

import nats.js.errors
import pytest

from tests.unit.deploy_checks import nats_authorization
from vigil.errors import RetryableError
from vigil.events import HaltJob
from vigil_common import credentials, subjects
from vigil_common.bus import Bus
from vigil_common.embedded import EmbeddedNats, free_port

pytestmark = pytest.mark.integration

AUTHORIZATION = nats_authorization()
COMPOSE_NATS_CONF = AUTHORIZATION.COMPOSE_FILE.parent / "nats.conf"


@dataclass
class Deployed:
    port: int
    passwords: dict[str, str]  # user -> password
    worker: str  # a worker's user

    def url(self, user: str) -> str:
        return credentials.with_user(f"nats://127.0.0.1:{self.port}", user, self.passwords[user])


def compose_config(root: Path, port: int) -> tuple[str, str]:
    text = COMPOSE_NATS_CONF.read_text()
    for old, new in (
        ('listen: "0.0.0.0:4222"', f'listen: "127.0.0.1:{port}"'),
        ('http: "127.0.0.1:8222"', f'http: "127.0.0.1:{free_port()}"'),
        ('store_dir: "/data/jetstream"', f'store_dir: "{root / "jetstream"}"'),
    ):
        assert old in text, f"deploy/nats/nats.conf no longer has {old}"
        text = text.replace(old, new)
    return text, AUTHORIZATION.COMPOSE_FILE.read_text()


def k8s_config(root: Path, port: int) -> tuple[str, str]:
    server = f'listen: "127.0.0.1:{port}"\njetstream {{\n  store_dir: "{root / "jetstream"}"\n}}\n'
    return server + 'include "authorization.conf"\n', AUTHORIZATION.k8s_conf(
        AUTHORIZATION.K8S_FILE.read_text()
    )


@pytest.fixture(params=["compose", "k8s"])
def deployed(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Deployed]:
    port = free_port()
    server, authorization = (compose_config if request.param == "compose" else k8s_config)(tmp_path, port)
    (tmp_path / "nats.conf").write_text(server)
    (tmp_path / "authorization.conf").write_text(authorization)
    variables = {
        user: entry["password"].removeprefix("$")
        for user, entry in AUTHORIZATION.users(authorization).items()
    }
    env = {name: f"test-{uuid.uuid4().hex}" for name in set(variables.values())}
    worker = sorted(u for u in variables if u.startswith("worker-"))[0]
    log = (tmp_path / "nats.log").open("wb")
    proc = subprocess.Popen(
        [EmbeddedNats.binary(), "-c", str(tmp_path / "nats.conf")], env=env, stdout=log, stderr=log
    )
    try:
        yield Deployed(port, {user: env[name] for user, name in variables.items()}, worker)
    finally:
        proc.terminate()
        proc.wait(15)
        log.close()


async def connect(deployed: Deployed, user: str) -> Bus:
    """The user's connection (Bus.connect retries while the server, just started, is not listening)."""
    return await Bus.connect(deployed.url(user), f"test-{user}")


@pytest.fixture
async def scheduler(deployed: Deployed) -> AsyncIterator[Bus]:
    bus = await connect(deployed, credentials.SCHEDULER)
    await bus.ensure_streams()  # what the deployed scheduler does at start, with its own user
    yield bus
    await bus.close()


async def stored_commands(deployed: Deployed, job_id: str) -> list[str]:
    admin = await connect(deployed, credentials.ADMIN)
    try:
        msg = await admin.js.get_last_msg(subjects.COMMANDS.name, subjects.cmd(job_id))
    except nats.js.errors.NotFoundError:
        return []
    finally:
        await admin.close()
    return [HaltJob.model_validate_json(msg.data or b"").reason]


async def test_workers_and_telemetry_cannot_command_and_the_guardian_can(
    deployed: Deployed, scheduler: Bus, job_id: str
) -> None:
    for user in (deployed.worker, credentials.TELEMETRY):
        bus = await connect(deployed, user)
        try:
            with pytest.raises(RetryableError):  # the server answers with a permissions violation
                await bus.publish(
                    subjects.cmd(job_id), HaltJob(job_id=job_id, attempt=1, reason=user), timeout_s=1.0
                )
        finally:
            await bus.close()
    assert await stored_commands(deployed, job_id) == []
    guardian = await connect(deployed, credentials.GUARDIAN)
    try:
        await guardian.publish(subjects.cmd(job_id), HaltJob(job_id=job_id, attempt=1, reason="guardian"))
    finally:
        await guardian.close()
    assert await stored_commands(deployed, job_id) == ["guardian"]
