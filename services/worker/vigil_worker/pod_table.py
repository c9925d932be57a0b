"""The ranks a worker runs as Kubernetes pods (VIGIL_RANK_RUNTIME=kubernetes): a `RankTable` whose ranks
are containers of one pod per job per node (`rank_pod`) instead of the worker's children.

The worker's agent drives it exactly as it drives its processes (start, poll, terminate, the SIGKILL
after the grace period); only the effects differ, and since the agent calls them synchronously, they are
queued and carried out by `run`, the table's own task, against the API server (`k8s_api`):

- `start` records a rank; once every rank of the job's attempt on this node is recorded, the job's
  ServiceAccount, NetworkPolicy (and, for a job spanning nodes, rank 0's Service) and its pod are created;
- `poll` answers from the pod's last listed status: a container's exit code (its log's tail and last
  step copied where the agent reads them first), or "lost" for a pod gone without one;
- `terminate` deletes the pod with a short grace period, the SIGKILL deletes it with none: the kubelet
  ends every process of every container, so nothing of the job survives a cancel, a preemption or a
  relaunch; once no rank of a job is left here, its ServiceAccount, NetworkPolicy and Service go too;
- a pod of this node that no rank here accounts for (a worker whose state was lost) is deleted.

Records carry a synthetic pid above Linux's largest (2^22), so no process of this node is ever signalled
for them. A rank's token is empty until its first link (`pod_relay` mints it).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import time
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from vigil.errors import ConfigError, PermanentError, RetryableError
from vigil.exits import last_step_path
from vigil_common.service import wait_any
from vigil_common.settings import Settings
from vigil_worker import rank_pod as rp
from vigil_worker.k8s_api import KubeApi, in_cluster_namespace
from vigil_worker.procs import Exit, RankRecord, RankTable, RankToStart

log = logging.getLogger("vigil.worker")

SYNC_INTERVAL_S = 1.0  # how often the pods are listed (one request per node)
TERMINATE_GRACE_S = 5  # a cancel's grace period, as the process runtime's SIGTERM-to-SIGKILL
GC_INTERVAL_S = 30.0  # how often leftover ServiceAccounts, policies and Services are looked for
LOG_TAIL_BYTES = 4000
PID_BASE = 1 << 22  # above /proc/sys/kernel/pid_max's largest value


def synthetic_pid(job_id: str, attempt: int, rank: int) -> int:
    return PID_BASE + zlib.crc32(f"{job_id}/{attempt}/{rank}".encode()) % (1 << 29)


@dataclass
class _Group:
    """A job attempt's ranks on this node, gathered until all are recorded."""

    expected: int
    containers: list[rp.RankContainer]
    launch_file: Path


class PodRankTable(RankTable):
    def __init__(
        self, state_dir: Path, settings: Settings, kind: str, api: KubeApi, worker_namespace: str
    ) -> None:
        super().__init__(state_dir)
        if not settings.rank_image:
            raise ConfigError("VIGIL_RANK_RUNTIME=kubernetes needs VIGIL_RANK_IMAGE (the rank pods' image)")
        self.settings, self.kind, self.api = settings, kind, api
        self.worker_namespace = worker_namespace
        self._groups: dict[tuple[str, int], _Group] = {}
        self._creating: dict[str, rp.PodPlan] = {}  # pod name -> its plan, until created
        self._deleting: dict[str, int] = {}  # pod name -> grace period (seconds)
        self._pods: dict[str, dict[str, Any]] | None = None  # pod name -> last listed pod (None: not yet)
        self._exits: dict[tuple[str, int, int], Exit] = {}
        self._last_gc = 0.0
        self._collect_soon = False  # a job's last rank here was reported: its objects can go

    # --- the agent's calls (synchronous: their effects are queued for `sync`) ----------------------------

    def start(
        self,
        who: RankToStart,
        argv: list[str],
        env: dict[str, str],
        *,
        cwd: Path | None = None,
        enter: Callable[[], None] | None = None,
    ) -> RankRecord:
        """Record one rank of the job's pod. No token (the relay mints it on the first link); its `uid` and
        `enter` are the process runtime's (a pod's uid is the job's own, `rank_pod.job_uid`): unused."""
        job_id, attempt, rank, device, exit_path = (
            who.job_id,
            who.attempt,
            who.rank,
            who.device,
            who.exit_path,
        )
        who.log_path.parent.mkdir(parents=True, exist_ok=True)
        record = RankRecord(
            job_id=job_id, attempt=attempt, rank=rank, device=device,
            pid=synthetic_pid(job_id, attempt, rank), ticks=0, log_path=str(who.log_path),
            exit_path=str(exit_path), token="", builtin=who.builtin, world_size=who.world_size,
        )  # fmt: skip
        launch_file = exit_path.parent / "launch.json"  # the built-in trainer's: from the pod's annotation
        argv = [rp.POD_LAUNCH_FILE if a == str(launch_file) else a for a in argv]
        group = self._groups.setdefault(
            (job_id, attempt), _Group(int(env.get("LOCAL_WORLD_SIZE", "1")), [], launch_file)
        )
        group.containers.append(rp.RankContainer(rank, device, argv, env, str(cwd) if cwd else None))
        self.records.append(record)
        self.save()
        if len(group.containers) == group.expected:
            plan = self.plan(job_id, attempt, group, env)
            self._creating[rp.pod_name(job_id, attempt, self.settings.node_name)] = plan
            del self._groups[(job_id, attempt)]
        return record

    def plan(self, job_id: str, attempt: int, group: _Group, env: dict[str, str]) -> rp.PodPlan:
        """The pod of a gathered group (the checkpoint folder made here, writable for the job's uid)."""
        s = self.settings
        folder = s.checkpoint_root.resolve() / job_id
        folder.mkdir(parents=True, exist_ok=True)
        os.chmod(folder, 0o777)  # the job's uid writes it; no other job's pod mounts it (a subPath)
        assert s.rank_image and s.node_address
        return rp.PodPlan(
            job_id=job_id, attempt=attempt, node=s.node_name, namespace=s.rank_namespace,
            worker_namespace=self.worker_namespace, image=s.rank_image,
            uid=rp.job_uid(job_id, s.rank_uid_base),
            kind=self.kind, ranks=group.containers, worker_address=s.node_address, relay_port=s.relay_port,
            checkpoint_dir=str(s.checkpoint_root / job_id), checkpoint_claim=s.rank_checkpoint_claim,
            launch_json=group.launch_file.read_text() if group.launch_file.exists() else "{}",
            multi_node=env.get("WORLD_SIZE") != env.get("LOCAL_WORLD_SIZE"),
            holds_rank0=env.get("NODE_RANK") == "0",
            grace_s=int(s.preemption_grace_s), cpu=s.rank_cpu, memory=s.rank_memory,
            cache_dir=str((s.data_dir / "cache").resolve()),
        )  # fmt: skip

    def find(self, job_id: str, attempt: int, rank: int) -> RankRecord | None:
        """The running rank, whether or not its token is minted yet (the relay checks its pod's IP)."""
        return next(
            (r for r in self.running(job_id) if r.attempt == attempt and r.rank == rank and not r.killed),
            None,
        )

    def poll(self, record: RankRecord) -> Exit | None:
        return self._exits.get(_key(record))  # what the last pass saw (`_observe`)

    def signal(self, record: RankRecord, sig: int) -> None:
        name = self.pod_of(record)
        if self._creating.pop(name, None) or self._groups.pop((record.job_id, record.attempt), None):
            return  # never made: nothing to end
        grace = 0 if sig == signal.SIGKILL else TERMINATE_GRACE_S
        self._deleting[name] = min(grace, self._deleting.get(name, grace))

    def notify(self, record: RankRecord, sig: int) -> None:
        """A pod's ranks cannot be signalled through the API: a preemption ends them with their pod."""
        log.warning("rank %d of %s runs in a pod: no preemption notice; it ends with its pod", record.rank,
                    record.job_id)  # fmt: skip

    def terminate(self, record: RankRecord) -> None:
        record.killed = True
        self.signal(record, signal.SIGTERM)
        self.save()

    def pod_of(self, record: RankRecord) -> str:
        return rp.pod_name(record.job_id, record.attempt, self.settings.node_name)

    def pod_ip(self, job_id: str, attempt: int) -> str | None:
        """The IP the API server gives the job attempt's pod here (what the relay admits links from)."""
        pod = (self._pods or {}).get(rp.pod_name(job_id, attempt, self.settings.node_name))
        if pod is None or pod.get("metadata", {}).get("deletionTimestamp"):
            return None
        ip: str | None = pod.get("status", {}).get("podIP")
        return ip

    def pod_ips(self) -> set[str]:
        return {ip for p in (self._pods or {}).values() if (ip := p.get("status", {}).get("podIP"))}

    # --- the table's own task ---------------------------------------------------------------------------

    async def run(self, stop: asyncio.Event) -> None:
        try:
            while not stop.is_set():
                try:
                    await self.sync()
                except RetryableError as exc:
                    log.warning("rank pods: %s; trying again", exc)
                except Exception:
                    log.exception("rank pods: a pass failed; trying again")
                await wait_any(stop, timeout_s=SYNC_INTERVAL_S)
        finally:
            await self.api.close()

    async def sync(self) -> None:
        """One pass: create what is queued, delete what is asked, read the pods, report what ended."""
        for name, plan in list(self._creating.items()):
            try:
                for doc in rp.objects(plan):
                    await self.api.create(doc)
            except PermanentError as exc:  # e.g. the namespace's admission refused it: the ranks fail
                log.error("rank pod %s: %s", name, exc)
                for container in plan.ranks:
                    self._fail(
                        plan.job_id, plan.attempt, container.rank, f"vigil: rank pod not created: {exc}\n"
                    )
            self._creating.pop(name, None)
        for name, grace in list(self._deleting.items()):
            await self.api.delete("Pod", name, grace)
            del self._deleting[name]
        pods = await self.api.list(
            "Pod", {**rp.RANK_LABELS, rp.LABEL_NODE: rp.label_value(self.settings.node_name)}
        )
        self._pods = {p["metadata"]["name"]: p for p in pods}
        live = {self.pod_of(r) for r in self.running()}
        for record in self.running():
            if _key(record) not in self._exits:
                await self._observe(record)
        for name, pod in self._pods.items():
            if (
                name not in live
                and name not in self._creating
                and not pod["metadata"].get("deletionTimestamp")
            ):
                log.info("deleting rank pod %s: no rank here accounts for it", name)
                await self.api.delete("Pod", name, 0)
        if self._collect_soon or time.monotonic() - self._last_gc > GC_INTERVAL_S:
            await self._collect()

    async def _observe(self, record: RankRecord) -> None:
        name = self.pod_of(record)
        if name in self._creating or (record.job_id, record.attempt) in self._groups:
            return
        pod = (self._pods or {}).get(name)
        if pod is None:  # gone, or never made (a refused create already set its exit)
            self._exits[_key(record)] = (
                Exit(None, signal.SIGKILL) if record.killed else Exit(None, None, lost=True)
            )
            return
        statuses = {c["name"]: c for c in pod.get("status", {}).get("containerStatuses", [])}
        state = statuses.get(f"rank-{record.rank}", {}).get("state", {})
        if (done := state.get("terminated")) is None:
            if pod.get("status", {}).get("phase") == "Failed":  # evicted, or refused by the kubelet
                reason = pod["status"].get("reason") or pod["status"].get("message") or "failed"
                self._fail(
                    record.job_id,
                    record.attempt,
                    record.rank,
                    f"vigil: rank pod {name}: {reason}\n",
                    lost=True,
                )
            return
        tail = await self.api.log_tail(name, f"rank-{record.rank}", LOG_TAIL_BYTES)
        if done.get("reason") == "OOMKilled":
            tail += "\nvigil: the container was OOMKilled (its memory limit, VIGIL_RANK_MEMORY)\n"
        message = str(done.get("message", "")).strip()
        _write_exit_files(record, tail, message if message.isdigit() else None)
        code = int(done.get("exitCode", 1))
        self._exits[_key(record)] = Exit(code, None) if code < 128 else Exit(None, code - 128)

    def _fail(self, job_id: str, attempt: int, rank: int, why: str, lost: bool = False) -> None:
        record = next((r for r in self.running(job_id) if r.attempt == attempt and r.rank == rank), None)
        if record is not None:
            with contextlib.suppress(OSError):
                Path(record.log_path).write_text(why)
            self._exits[_key(record)] = Exit(None, None, lost=lost)

    async def _collect(self) -> None:
        """Delete this node's ServiceAccounts, policies and Services of jobs with no rank left here."""
        self._last_gc, self._collect_soon = time.monotonic(), False
        jobs = {rp.label_value(r.job_id) for r in self.running()}
        jobs |= {rp.label_value(p.job_id) for p in self._creating.values()}
        selector = {**rp.RANK_LABELS, rp.LABEL_NODE: rp.label_value(self.settings.node_name)}
        for kind in ("ServiceAccount", "NetworkPolicy", "Service"):
            for doc in await self.api.list(kind, selector):
                if doc["metadata"].get("labels", {}).get(rp.LABEL_JOB) not in jobs:
                    await self.api.delete(kind, doc["metadata"]["name"])

    def mark_reported(self, record: RankRecord) -> None:
        self._exits.pop(_key(record), None)
        super().mark_reported(record)
        self._collect_soon = not self.running(record.job_id)


def _write_exit_files(record: RankRecord, log_tail: str, last_step: str | None) -> None:
    """Where the agent reads a rank's end: its log's tail, and the last step its pod's status gave."""
    Path(record.log_path).write_text(log_tail)
    if last_step is not None:
        last_step_path(record.exit_path).write_text(f"{last_step}\n")


def _key(record: RankRecord) -> tuple[str, int, int]:
    return record.job_id, record.attempt, record.rank


def pod_table(settings: Settings, kind: str, state_dir: Path) -> PodRankTable | None:
    """The pod table where VIGIL_RANK_RUNTIME=kubernetes; None for the worker's own processes."""
    if settings.rank_runtime != "kubernetes":
        return None
    namespace = in_cluster_namespace() or "default"
    api = KubeApi.in_cluster(settings.rank_namespace, settings.k8s_api_url)
    return PodRankTable(state_dir, settings, kind, api, namespace)
