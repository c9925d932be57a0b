"""Ranks as Kubernetes pods (VIGIL_RANK_RUNTIME=kubernetes): the worker's `PodRankTable` and `PodRelay`.

No API server runs here, so `FakeApiServer` is one: a minimal HTTP server implementing only the calls the
worker makes (create, list by label, delete, a container's log, for pods, serviceaccounts, services and
networkpolicies in one namespace). It is a stand-in, not Kubernetes: it validates what it is sent against
the Kubernetes 1.31 schemas (kubernetes-validate, strict) and checks the bearer token, and a test plays
the kubelet by writing a pod's container statuses. The relay, the SDK's link and NATS are the real ones.
"""

from __future__ import annotations

import asyncio
import json
import re
import signal
import threading
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlsplit

import kubernetes_validate
import pytest

from tests.helpers import step_completed
from vigil import events as ev
from vigil import protocol as proto
from vigil.exits import read_last_step
from vigil.link import AgentLink
from vigil_common import subjects
from vigil_common.settings import Settings
from vigil_worker import rank_pod as rp
from vigil_worker.k8s_api import KubeApi
from vigil_worker.pod_relay import PodRelay
from vigil_worker.pod_table import TERMINATE_GRACE_S, PodRankTable
from vigil_worker.procs import Exit, RankToStart

pytestmark = pytest.mark.integration

NODE = "node-a"
NAMESPACE = "vigil-jobs"
API_TOKEN = "sa-token-" + "k" * 30
_PATH = re.compile(
    r"^/(?:api/v1|apis/networking\.k8s\.io/v1)/namespaces/([^/]+)/([a-z]+)(?:/([^/]+))?(/log)?$"
)


@dataclass
class FakeApiServer:
    pod_ip: str = "127.0.0.1"
    objects: dict[tuple[str, str], dict[str, Any]] = field(default_factory=dict)
    deletes: list[tuple[str, str, int | None]] = field(default_factory=list)
    logs: dict[tuple[str, str], str] = field(default_factory=dict)
    refuse: set[str] = field(default_factory=set)  # resources whose creation is forbidden (403)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def handle(self, method: str, url: str, auth: str | None, body: bytes) -> tuple[int, Any]:
        if auth != f"Bearer {API_TOKEN}":
            return 401, {"message": "Unauthorized"}
        parts = urlsplit(url)
        match = _PATH.match(parts.path)
        if match is None or match.group(1) != NAMESPACE:
            return 404, {"message": f"no such path {parts.path}"}
        _, resource, name, log = match.groups()
        query = {k: v[0] for k, v in parse_qs(parts.query).items()}
        with self.lock:
            if method == "POST":
                doc = json.loads(body)
                try:
                    kubernetes_validate.validate(doc, "1.31", strict=True)
                except kubernetes_validate.ValidationError as exc:
                    return 422, {"message": f"invalid: {exc.message}"}
                if resource in self.refuse:
                    return 403, {"message": f"{resource} is forbidden: the test says no"}
                key = (resource, doc["metadata"]["name"])
                if key in self.objects:
                    return 409, {"message": "AlreadyExists"}
                if resource == "pods":
                    doc["status"] = {"phase": "Pending", "podIP": self.pod_ip}
                self.objects[key] = doc
                return 201, doc
            if method == "GET" and log:
                text = self.logs.get((name, query.get("container", "")))
                return (200, text) if text is not None else (400, {"message": "no log"})
            if method == "GET":
                want = dict(p.split("=", 1) for p in query.get("labelSelector", "").split(",") if p)
                items = [
                    d for (r, _), d in self.objects.items()
                    if r == resource and want.items() <= d["metadata"].get("labels", {}).items()
                ]  # fmt: skip
                return 200, {"items": items}
            if method == "DELETE":
                grace = json.loads(body or b"{}").get("gracePeriodSeconds")
                self.deletes.append((resource, name, grace))
                return (
                    (200, {}) if self.objects.pop((resource, name), None) else (404, {"message": "NotFound"})
                )
        return 405, {"message": method}

    def terminate(self, pod: str, container: str, code: int, message: str = "", reason: str = "") -> None:
        """Play the kubelet: one container of the pod has ended."""
        with self.lock:
            status = self.objects[("pods", pod)]["status"]
            terminated = {"exitCode": code, "message": message, **({"reason": reason} if reason else {})}
            status.setdefault("containerStatuses", []).append(
                {"name": container, "state": {"terminated": terminated}}
            )

    def of(self, resource: str) -> list[dict[str, Any]]:
        with self.lock:
            return [d for (r, _), d in self.objects.items() if r == resource]


@pytest.fixture
def api_server() -> Iterator[tuple[FakeApiServer, str]]:
    fake = FakeApiServer()

    class Handler(BaseHTTPRequestHandler):
        def _answer(self) -> None:
            body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
            code, answer = fake.handle(self.command, self.path, self.headers.get("Authorization"), body)
            data = answer.encode() if isinstance(answer, str) else json.dumps(answer).encode()
            self.send_response(code)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        do_GET = do_POST = do_DELETE = _answer

        def log_message(self, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield fake, f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


@pytest.fixture
async def table(api_server, tmp_path: Path) -> AsyncIterator[tuple[PodRankTable, FakeApiServer]]:
    fake, url = api_server
    (tmp_path / "token").write_text(API_TOKEN)
    settings = Settings.load(
        data_dir=tmp_path / "data", node_name=NODE, node_address="127.0.0.1", rank_runtime="kubernetes",
        rank_image="vigil-worker:dev", rank_namespace=NAMESPACE,
    )  # fmt: skip
    api = KubeApi(url, NAMESPACE, token_file=tmp_path / "token")
    t = PodRankTable(tmp_path / "state", settings, "cpu", api, "vigil")
    yield t, fake
    await api.close()


def _read(path: str) -> str:
    return Path(path).read_text()


def start(t: PodRankTable, job_id: str, rank: int, local_world: int = 2, attempt: int = 1):
    run_dir = t.settings.data_dir / "runs" / job_id / f"attempt-{attempt}"
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "launch.json").write_text(json.dumps({"job_id": job_id}))
    env = {"RANK": str(rank), "LOCAL_WORLD_SIZE": str(local_world), "WORLD_SIZE": str(local_world),
           "NODE_RANK": "0", proto.RANK_TOKEN_FD_ENV: "never-in-a-pod-spec-fd"}  # fmt: skip
    argv = ["python", "-m", "vigil_trainer", "--launch", str(run_dir / "launch.json")]
    who = RankToStart(
        job_id=job_id, attempt=attempt, rank=rank, device=rank, builtin=True, world_size=local_world,
        log_path=t.settings.log_dir / job_id / f"rank-{rank}.log", exit_path=run_dir / f"rank-{rank}.exit",
    )  # fmt: skip
    return t.start(who, argv, env)


async def test_a_jobs_ranks_become_one_pod_whose_exits_are_reported_and_whose_objects_go_after(table, job_id):
    t, fake = table
    r0 = start(t, job_id, 0)
    await t.sync()
    assert not fake.of("pods"), "no pod until every rank of the attempt here is recorded"
    r1 = start(t, job_id, 1)
    await t.sync()
    (pod,) = fake.of("pods")
    name = pod["metadata"]["name"]
    assert [c["name"] for c in pod["spec"]["containers"]] == ["rank-0", "rank-1"]
    assert pod["spec"]["containers"][0]["command"][-1] == rp.POD_LAUNCH_FILE
    assert len(fake.of("serviceaccounts")) == len(fake.of("networkpolicies")) == 1
    everything = json.dumps(list(fake.objects.values()))
    assert "never-in-a-pod-spec-fd" not in everything and proto.RANK_TOKEN_FD_ENV not in everything
    assert t.pod_ip(job_id, 1) == "127.0.0.1" and t.find(job_id, 1, 0) is r0 and r0.token == ""
    assert r0.world_size == 2  # what the relay bounds a report's ranks by
    assert t.poll(r0) is None

    fake.logs[(name, "rank-0")] = "rank 0 trained\n"
    fake.terminate(name, "rank-0", 0, message="17")
    fake.logs[(name, "rank-1")] = "rank 1 ran out\n"
    fake.terminate(name, "rank-1", 137, reason="OOMKilled")
    await t.sync()
    assert t.poll(r0) == Exit(0, None) and read_last_step(r0.exit_path) == 17
    assert _read(r0.log_path) == "rank 0 trained\n"
    assert t.poll(r1) == Exit(None, signal.SIGKILL) and "OOMKilled" in _read(r1.log_path)

    t.mark_reported(r0)
    t.mark_reported(r1)
    await t.sync()
    assert ("pods", name, 0) in fake.deletes, "a pod whose ranks are all reported goes at once"
    assert not fake.objects, f"left behind: {list(fake.objects)}"


async def test_cancel_deletes_the_pod_with_a_grace_period_then_without(table, job_id):
    t, fake = table
    ranks = [start(t, job_id, 0, local_world=1)]
    await t.sync()
    (pod,) = fake.of("pods")
    name = pod["metadata"]["name"]
    t.terminate(ranks[0])
    assert t.find(job_id, 1, 0) is None, "a rank being ended links no more"
    t.signal(ranks[0], signal.SIGKILL)  # the agent's SIGKILL after the grace period
    await t.sync()
    assert ("pods", name, 0) in fake.deletes and ("pods", name, TERMINATE_GRACE_S) not in fake.deletes
    assert t.poll(ranks[0]) == Exit(None, signal.SIGKILL)  # the agent reports it killed_by_vigil


async def test_terminate_alone_asks_for_the_grace_period(table, job_id):
    t, fake = table
    rank = start(t, job_id, 0, local_world=1)
    await t.sync()
    t.terminate(rank)
    await t.sync()
    assert fake.deletes == [("pods", rp.pod_name(job_id, 1, NODE), TERMINATE_GRACE_S)]


async def test_a_pod_no_rank_accounts_for_is_deleted_and_a_refused_pod_fails_its_ranks(table, job_id):
    t, fake = table
    stray = rp.rank_pod(
        rp.PodPlan(
            job_id="old-job", attempt=1, node=NODE, namespace=NAMESPACE, worker_namespace="vigil", image="x",
            uid=200_001, kind="cpu", ranks=[rp.RankContainer(0, 0, ["x"], {})], worker_address="127.0.0.1",
            relay_port=1, checkpoint_dir="/c/old-job", checkpoint_claim="c", launch_json="{}",
            multi_node=False, holds_rank0=True,
        )
    )  # fmt: skip
    fake.objects[("pods", stray["metadata"]["name"])] = stray
    fake.refuse.add("pods")
    rank = start(t, job_id, 0, local_world=1)
    await t.sync()
    assert ("pods", stray["metadata"]["name"], 0) in fake.deletes, "a worker that lost its state leaves none"
    assert t.poll(rank) == Exit(None, None) and "forbidden" in _read(rank.log_path)


# --- the relay: links admitted by the pod's IP, the token minted on the first ------------------------------


def step(job_id: str, n: int) -> ev.StepCompleted:
    return step_completed(job_id, n, loss=1.0, node=NODE)


async def raw_hello(relay: PodRelay, hello: proto.Hello, source: str = "127.0.0.1") -> bytes:
    reader, writer = await asyncio.open_connection(relay.host, relay.port, local_addr=(source, 0))
    try:
        writer.write(proto.encode_frame(hello))
        await writer.drain()
        return await asyncio.wait_for(reader.readline(), 10)
    except ConnectionResetError:  # closed unread: the hello's bytes reset the connection
        return b""
    finally:
        writer.close()


@pytest.mark.security
async def test_the_relay_admits_only_the_pods_address_and_then_only_its_token(table, bus, job_id):
    t, fake = table
    start(t, job_id, 0)
    start(t, job_id, 1)
    await t.sync()
    relay = await PodRelay(bus, NODE, "127.0.0.1", 0, t.settings.checkpoint_root, t).start()
    try:
        # the rank's first link: no token; it gets one, and its events reach the bus
        link = await asyncio.to_thread(
            AgentLink(relay.address, proto.Hello(job_id=job_id, attempt=1, rank=0, token="")).start, 10.0
        )
        minted = t.find(job_id, 1, 0).token
        assert len(minted) >= 32 and link.hello.token == minted
        async with bus.watch(subjects.step(job_id, NODE)) as stream:
            link.emit(step(job_id, 1))
            got = await asyncio.wait_for(anext(stream), 10)
        assert got.step == 1
        await asyncio.to_thread(link.close)
        # from the pod's address, but without (or with another) token: rank 0 is taken
        for token in ("", "z" * 40):
            answer = await raw_hello(relay, proto.Hello(job_id=job_id, attempt=1, rank=0, token=token))
            assert proto.decode_agent_frame(answer).reason == "not this rank's token"
        # an attempt or a job that has no pod at this address
        answer = await raw_hello(relay, proto.Hello(job_id="someone-else", attempt=1, rank=0, token=""))
        assert isinstance(proto.decode_agent_frame(answer), proto.Refused)
        # another address (another pod): closed before a byte is read, whatever it claims
        answer = await raw_hello(relay, proto.Hello(job_id=job_id, attempt=1, rank=1, token=""), "127.0.0.2")
        assert answer == b"" and relay.turned_away == 1
        assert t.find(job_id, 1, 1).token == "", "rank 1's token was not minted for the other address"
        # rank 1's own first link, from the pod: admitted
        answer = await raw_hello(relay, proto.Hello(job_id=job_id, attempt=1, rank=1, token=""))
        welcome = proto.decode_agent_frame(answer)
        assert isinstance(welcome, proto.Welcome) and welcome.token == t.find(job_id, 1, 1).token != minted
        # the pod deleted: its address admits nothing any more
        fake.objects.clear()
        await t.sync()
        answer = await raw_hello(relay, proto.Hello(job_id=job_id, attempt=1, rank=1, token=welcome.token))
        assert answer == b"" and relay.turned_away == 2
    finally:
        await relay.close()
