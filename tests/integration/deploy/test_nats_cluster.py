"""The Kubernetes manifests' NATS (deploy/k8s/base/nats.yaml), run for real: three nats-servers from
its ConfigMaps (ports and route hosts moved to this machine; the users of nats-authorization.yaml),
Vigil's streams created with VIGIL_STREAM_REPLICAS=3 by the scheduler's user, and publishing that
goes on when one server is stopped."""

from __future__ import annotations

import re
import subprocess
import uuid
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import yaml

from tests.helpers import eventually
from tests.unit.deploy_checks import nats_authorization
from vigil.events import CancelJob
from vigil_common import credentials, subjects
from vigil_common.bus import Bus
from vigil_common.embedded import EmbeddedNats, free_port

pytestmark = pytest.mark.integration

NATS_YAML = Path(__file__).resolve().parents[3] / "deploy" / "k8s" / "base" / "nats.yaml"
AUTHORIZATION = nats_authorization()


def config_map_text() -> str:
    (config_map,) = [d for d in yaml.safe_load_all(NATS_YAML.read_text()) if d and d["kind"] == "ConfigMap"]
    return config_map["data"]["nats.conf"]


def local_config(
    text: str, me: int, clients: list[int], routes: list[int], monitors: list[int], root: Path
) -> str:
    """The ConfigMap's config for server `me` on this machine: the same blocks, local ports and paths."""
    text = text.replace('"0.0.0.0:4222"', f'"127.0.0.1:{clients[me]}"')
    text = text.replace('"0.0.0.0:8222"', f'"127.0.0.1:{monitors[me]}"')
    text = text.replace('"0.0.0.0:6222"', f'"127.0.0.1:{routes[me]}"')
    text = re.sub(
        r'"nats://nats-(\d)\.nats-cluster:6222"', lambda m: f'"nats://127.0.0.1:{routes[int(m[1])]}"', text
    )
    assert text.count("127.0.0.1") == 6, "the ConfigMap's listen addresses or routes changed"
    return text.replace('store_dir: "/data/jetstream"', f'store_dir: "{root / f"nats-{me}"}"')


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[tuple[list[str], list[subprocess.Popen[bytes]]]]:
    clients, routes, monitors = ([free_port() for _ in range(3)] for _ in range(3))
    text = config_map_text()
    users = AUTHORIZATION.k8s_conf(AUTHORIZATION.K8S_FILE.read_text())
    (tmp_path / "authorization.conf").write_text(users)  # beside the configs that include it
    passwords = {
        e["password"].removeprefix("$"): uuid.uuid4().hex for e in AUTHORIZATION.users(users).values()
    }
    procs = []
    try:
        for i in range(3):
            conf = tmp_path / f"nats-{i}.conf"
            conf.write_text(local_config(text, i, clients, routes, monitors, tmp_path))
            env = {"POD_NAME": f"nats-{i}", **passwords}
            log = (tmp_path / f"nats-{i}.log").open("wb")
            procs.append(
                subprocess.Popen([EmbeddedNats.binary(), "-c", str(conf)], env=env, stdout=log, stderr=log)
            )
        yield (
            [f"http://127.0.0.1:{m}" for m in monitors]
            + [
                credentials.with_user(
                    f"nats://127.0.0.1:{clients[0]}",
                    credentials.SCHEDULER,
                    passwords[AUTHORIZATION.password_variable(credentials.SCHEDULER)],
                )
            ],
            procs,
        )
    finally:
        for proc in procs:
            proc.terminate()
            proc.wait(15)


async def test_vigils_streams_live_on_three_servers_and_outlive_one(cluster) -> None:
    endpoints, procs = cluster
    monitors, url = endpoints[:3], endpoints[3]

    async def jetstream_ready() -> bool:
        async with httpx.AsyncClient(timeout=2) as http:
            try:
                codes = [(await http.get(f"{m}/healthz?js-enabled-only=true")).status_code for m in monitors]
            except httpx.HTTPError:
                return False
        return codes == [200, 200, 200]

    await eventually(jetstream_ready, timeout=60, what="three JetStream servers")
    bus = await Bus.connect(url, name="cluster-test")
    try:

        async def streams_created() -> bool:
            try:
                await bus.ensure_streams(replicas=3)  # the meta leader may still be elected
            except Exception:
                return False
            return True

        await eventually(streams_created, timeout=60, what="Vigil's streams with 3 replicas")
        info = await bus.js.stream_info(subjects.COMMANDS.name)
        assert info.config.num_replicas == 3
        assert info.cluster is not None and len(info.cluster.replicas or []) == 2

        procs[2].terminate()  # one server goes (a pod rescheduled): two of three still make a quorum
        procs[2].wait(15)
        job = "j-" + uuid.uuid4().hex[:12]

        async def published() -> bool:
            try:
                await bus.publish(
                    subjects.cmd(job), CancelJob(job_id=job, attempt=1, reason="test"), timeout_s=3
                )
            except Exception:
                return False
            return True

        await eventually(published, timeout=30, what="a publish with one server down")
    finally:
        await bus.close()
