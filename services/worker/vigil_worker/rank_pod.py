"""A job's ranks on one node as Kubernetes objects: pure builders, no API calls (`pod_table` sends them).

Per job and node the worker makes one Pod, one ServiceAccount and one NetworkPolicy (and, for a job that
spans nodes, rank 0's node makes one headless Service: the rendezvous address). All of them carry the
labels `vigil.dev/job`, `vigil.dev/node` (and the pod `vigil.dev/attempt`), and go when the job's ranks
here end.

**One container per rank, in one pod per job per node.** The containers of a pod share its network and
IPC namespaces, so the node's ranks rendezvous on 127.0.0.1 and NCCL's shared-memory transport works
through the pod's /dev/shm, while the kubelet reports each rank's own exit code (and OOM kill) in the
pod's status, each container has its own limits, and each rank's log is its container's. The cost: a
rank sees only its own GPU, so NCCL between ranks of one node goes through shared memory, not NVLink
peer-to-peer. A rank's GPU is the device Vigil placed it on (`NVIDIA_VISIBLE_DEVICES`, read by the
NVIDIA container runtime; the worker's DaemonSet holds the node's GPUs through the device plugin, so no
other pod is scheduled onto them).

**What the pod holds.** It runs as a uid/gid of its own job (`job_uid`), non-root, with no supplementary
groups, every capability dropped, no privilege escalation, seccomp RuntimeDefault and a read-only root
file system; writable are only its emptyDirs (/tmp, /dev/shm, the exit folder, the data cache, each
with a size limit) and its job's own checkpoint folder (a subPath of the checkpoint claim: other jobs'
folders are not in its mount namespace). Its ServiceAccount has no role binding and its token is not
mounted; no Secret is a volume or an env source; service links are off. The launch event (the job's
spec, nothing secret) reaches the built-in trainer as an annotation projected by the downward API.
**The rank's relay token is nowhere in the spec**: anyone with pods/get in the namespace reads the spec,
so the token is minted by the relay on the rank's first link, which the relay admits only from this
pod's IP as the API server reports it (`pod_relay`).

**The NetworkPolicy** (selecting the job's pods on this node) lets in only the job's own rank pods (the
process group: rendezvous and collectives, on any node), and lets out only to those pods, to the
workers' relay port (the relay then admits only its own node's pods, by IP) and, for a job that spans
nodes, to the cluster DNS (the rendezvous Service's name). Nothing else: not NATS, not the API server,
not the internet.
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass, field
from typing import Any

Doc = dict[str, Any]

LABEL_JOB, LABEL_NODE, LABEL_ATTEMPT = "vigil.dev/job", "vigil.dev/node", "vigil.dev/attempt"
ANNOTATION_JOB_ID, ANNOTATION_LAUNCH = "vigil.dev/job-id", "vigil.dev/launch"
RANK_LABELS = {
    "app.kubernetes.io/name": "vigil-rank",
    "app.kubernetes.io/component": "rank",
    "app.kubernetes.io/managed-by": "vigil-worker",
}
WORKER_LABELS = {"app.kubernetes.io/name": "vigil-worker"}  # the DaemonSet's pods (the relay's side)
POD_LAUNCH_DIR = "/vigil/launch"  # the launch event, from the pod's annotation
POD_LAUNCH_FILE = f"{POD_LAUNCH_DIR}/launch.json"
POD_EXIT_DIR = "/vigil/exit"  # each rank's exit code and last step (the termination message)
UID_SPAN = 1 << 20  # job uids: base .. base + UID_SPAN - 1
_LABEL_VALUE = re.compile(r"^[A-Za-z0-9]([A-Za-z0-9_.-]{0,61}[A-Za-z0-9])?$")


def _digest(text: str, n: int) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:n]


def _slug(text: str, n: int) -> str:
    """Lower-case letters, digits and '-' only, at most n, no '-' at either end."""
    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-")[:n].strip("-")


def label_value(text: str) -> str:
    """`text` itself where Kubernetes takes it as a label value; otherwise a stable digest of it."""
    return text if _LABEL_VALUE.match(text) else f"h-{_digest(text, 20)}"


def job_uid(job_id: str, base: int) -> int:
    """The uid (and gid) a job's rank pods run as: base plus a number from the job id. Two jobs may draw
    the same number (1 in 2^20): the pod, not the uid, is the boundary between jobs here."""
    return base + int(_digest(job_id, 8), 16) % UID_SPAN


def names(job_id: str, node: str) -> tuple[str, str]:
    """(the job's stem, the stem of its objects on `node`): DNS labels, stable, distinct per job."""
    job = f"vigil-{_slug(job_id, 24) or 'job'}-{_digest(job_id, 8)}"
    return job, f"{job}-{_slug(node, 12) or 'n'}{_digest(node, 4)}"


def pod_name(job_id: str, attempt: int, node: str) -> str:
    return f"{names(job_id, node)[1]}-a{attempt}"


def rendezvous_host(job_id: str, namespace: str) -> str:
    """The DNS name of rank 0's pod for the job's other nodes (its headless Service)."""
    return f"{names(job_id, '')[0]}.{namespace}.svc"


@dataclass(frozen=True)
class RankContainer:
    rank: int
    device: int
    argv: list[str]
    env: dict[str, str]  # what the rank sees besides what `rank_pod` sets (no token: see the docstring)
    cwd: str | None = None


@dataclass(frozen=True)
class PodPlan:
    """Everything a job's pod on one node is built from."""

    job_id: str
    attempt: int
    node: str  # the Kubernetes node (Vigil's node name)
    namespace: str  # the rank pods' namespace
    worker_namespace: str  # where the workers (and their relay) run
    image: str
    uid: int
    kind: str  # "gpu" or "cpu"
    ranks: list[RankContainer]
    worker_address: str  # the node's worker pod IP: the relay
    relay_port: int
    checkpoint_dir: str  # the job's own checkpoint folder, as the ranks see it
    checkpoint_claim: str
    launch_json: str
    multi_node: bool  # the job spans nodes: ranks rendezvous through rank 0's Service
    holds_rank0: bool
    grace_s: int = 30
    cpu: str = "2"
    memory: str = "8Gi"
    shm: str = "2Gi"
    scratch: str = "10Gi"  # /tmp and the data cache, each
    cache_dir: str = "/var/lib/vigil/cache"
    image_pull_policy: str | None = None
    extra_labels: dict[str, str] = field(default_factory=dict)

    @property
    def labels(self) -> dict[str, str]:
        return {
            **RANK_LABELS,
            LABEL_JOB: label_value(self.job_id),
            LABEL_NODE: label_value(self.node),
            **self.extra_labels,
        }


def _meta(name: str, plan: PodPlan, labels: dict[str, str] | None = None) -> Doc:
    return {
        "name": name,
        "namespace": plan.namespace,
        "labels": labels or {k: v for k, v in plan.labels.items() if k != LABEL_ATTEMPT},
        "annotations": {ANNOTATION_JOB_ID: plan.job_id},
    }


def service_account(plan: PodPlan) -> Doc:
    """The job's own ServiceAccount on this node: no role binds it, and its token is never mounted."""
    return {
        "apiVersion": "v1",
        "kind": "ServiceAccount",
        "metadata": _meta(names(plan.job_id, plan.node)[1], plan),
        "automountServiceAccountToken": False,
    }


def rank_env(plan: PodPlan, rank: RankContainer) -> list[Doc]:
    """A rank container's environment: the rank's own, then what the pod decides (and the job may not)."""
    env = {k: v for k, v in rank.env.items() if not k.startswith("VIGIL_RANK_TOKEN")}  # minted on the link
    for name in ("GLOO_SOCKET_IFNAME", "MASTER_ADDR"):
        env.pop(name, None)  # gloo and the store find the pod's own address
    env.update(
        VIGIL_AGENT_SOCKET=f"tcp://{plan.worker_address}:{plan.relay_port}",
        VIGIL_EXIT_FILE=f"{POD_EXIT_DIR}/rank-{rank.rank}.exit",
        HOME="/tmp",
        TMPDIR="/tmp",
    )
    if plan.kind == "gpu":  # its placed device, alone: inside the container it is device 0
        env.update(NVIDIA_VISIBLE_DEVICES=str(rank.device), CUDA_VISIBLE_DEVICES="0")
    else:
        env.update(NVIDIA_VISIBLE_DEVICES="void", CUDA_VISIBLE_DEVICES="")
    out: list[Doc] = [{"name": k, "value": v} for k, v in env.items()]
    if not plan.multi_node:
        out.append({"name": "MASTER_ADDR", "value": "127.0.0.1"})  # the pod's ranks share its network
    elif plan.holds_rank0:  # the store listens on MASTER_ADDR: the pod's own IP
        out.append({"name": "MASTER_ADDR", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}})
    else:
        out.append({"name": "MASTER_ADDR", "value": rendezvous_host(plan.job_id, plan.namespace)})
    return out


def rank_pod(plan: PodPlan) -> Doc:
    """The job's pod on this node: one container per rank (see the module's docstring)."""
    if not plan.ranks:
        raise ValueError(f"job {plan.job_id}: a rank pod needs at least one rank")
    limits = {"cpu": plan.cpu, "memory": plan.memory, "ephemeral-storage": plan.scratch}
    containers = []
    for r in sorted(plan.ranks, key=lambda r: r.rank):
        container: Doc = {
            "name": f"rank-{r.rank}",
            "image": plan.image,
            "command": list(r.argv),  # an argument list; the image's entry point is not the rank's
            "env": rank_env(plan, r),
            "resources": {"requests": dict(limits), "limits": dict(limits)},
            "securityContext": {
                "allowPrivilegeEscalation": False,
                "readOnlyRootFilesystem": True,
                "runAsNonRoot": True,
                "privileged": False,
                "capabilities": {"drop": ["ALL"]},
            },
            "volumeMounts": [
                {"name": "tmp", "mountPath": "/tmp"},
                {"name": "shm", "mountPath": "/dev/shm"},
                {"name": "exit", "mountPath": POD_EXIT_DIR},
                {"name": "launch", "mountPath": POD_LAUNCH_DIR, "readOnly": True},
                {"name": "cache", "mountPath": plan.cache_dir},
                {  # its own job's folder only: the claim's other folders are not mounted
                    "name": "checkpoints",
                    "mountPath": plan.checkpoint_dir,
                    "subPath": plan.checkpoint_dir.rstrip("/").rsplit("/", 1)[-1],
                },
            ],
            "terminationMessagePath": f"{POD_EXIT_DIR}/rank-{r.rank}.step",  # its last step
            "terminationMessagePolicy": "File",
        }
        if r.cwd:
            container["workingDir"] = r.cwd
        if plan.image_pull_policy:
            container["imagePullPolicy"] = plan.image_pull_policy
        containers.append(container)
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            **_meta(
                pod_name(plan.job_id, plan.attempt, plan.node),
                plan,
                {**plan.labels, LABEL_ATTEMPT: str(plan.attempt)},
            ),
            "annotations": {ANNOTATION_JOB_ID: plan.job_id, ANNOTATION_LAUNCH: plan.launch_json},
        },
        "spec": {
            "nodeName": plan.node,
            "serviceAccountName": names(plan.job_id, plan.node)[1],
            "automountServiceAccountToken": False,
            "enableServiceLinks": False,  # no variables naming the namespace's Services
            "restartPolicy": "Never",  # a rank that ends is reported; the scheduler relaunches the job
            "terminationGracePeriodSeconds": plan.grace_s,
            "securityContext": {
                "runAsNonRoot": True,
                "runAsUser": plan.uid,
                "runAsGroup": plan.uid,
                "supplementalGroups": [],
                "seccompProfile": {"type": "RuntimeDefault"},
            },
            "containers": containers,
            "volumes": [
                {"name": "tmp", "emptyDir": {"sizeLimit": plan.scratch}},
                {"name": "shm", "emptyDir": {"medium": "Memory", "sizeLimit": plan.shm}},
                {"name": "exit", "emptyDir": {"sizeLimit": "1Mi"}},
                {"name": "cache", "emptyDir": {"sizeLimit": plan.scratch}},
                {
                    "name": "launch",
                    "downwardAPI": {
                        "items": [
                            {
                                "path": "launch.json",
                                "fieldRef": {"fieldPath": f"metadata.annotations['{ANNOTATION_LAUNCH}']"},
                            }
                        ]
                    },
                },
                {"name": "checkpoints", "persistentVolumeClaim": {"claimName": plan.checkpoint_claim}},
            ],
        },
    }


def network_policy(plan: PodPlan) -> Doc:
    """What the job's pods on this node may reach and be reached by (see the module's docstring)."""
    job = {"podSelector": {"matchLabels": {LABEL_JOB: label_value(plan.job_id)}}}
    relay = {
        "to": [
            {
                "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": plan.worker_namespace}},
                "podSelector": {"matchLabels": dict(WORKER_LABELS)},
            }
        ],
        "ports": [{"protocol": "TCP", "port": plan.relay_port}],
    }
    egress: list[Doc] = [relay, {"to": [job]}]
    if plan.multi_node:
        egress.append(
            {
                "to": [
                    {
                        "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "kube-system"}},
                        "podSelector": {"matchLabels": {"k8s-app": "kube-dns"}},
                    }
                ],
                "ports": [{"protocol": "UDP", "port": 53}, {"protocol": "TCP", "port": 53}],
            }
        )
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": _meta(names(plan.job_id, plan.node)[1], plan),
        "spec": {
            "podSelector": {
                "matchLabels": {LABEL_JOB: label_value(plan.job_id), LABEL_NODE: label_value(plan.node)}
            },
            "policyTypes": ["Ingress", "Egress"],
            "ingress": [{"from": [job]}],
            "egress": egress,
        },
    }


def rendezvous_service(plan: PodPlan) -> Doc:
    """For a job that spans nodes, made by rank 0's node: a headless Service naming rank 0's pod (its
    address published before the pod is ready: the store must be reachable while the ranks start)."""
    job = names(plan.job_id, "")[0]
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": _meta(
            job,
            plan,
            {**RANK_LABELS, LABEL_JOB: label_value(plan.job_id), LABEL_NODE: label_value(plan.node)},
        ),
        "spec": {
            "clusterIP": "None",
            "publishNotReadyAddresses": True,
            "selector": {LABEL_JOB: label_value(plan.job_id), LABEL_NODE: label_value(plan.node)},
        },
    }


def objects(plan: PodPlan) -> list[Doc]:
    """What the worker creates for the plan, in order (the pod last: it names the ServiceAccount)."""
    docs = [service_account(plan), network_policy(plan)]
    if plan.multi_node and plan.holds_rank0:
        docs.append(rendezvous_service(plan))
    return [*docs, rank_pod(plan)]
