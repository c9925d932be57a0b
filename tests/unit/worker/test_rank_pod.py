"""The rank pod's objects (vigil_worker.rank_pod), built without a cluster: valid against the Kubernetes
1.31 schemas (kubernetes-validate, strict, as tests/unit/test_k8s.py validates the manifests), within the
"restricted" Pod Security Standard, with no Secret and no token anywhere, the job's labels, its limits,
and a NetworkPolicy that lets the pod reach only its job's pods and the workers' relay."""

from __future__ import annotations

import json
import re

import kubernetes_validate
import pytest

from vigil_worker import rank_pod as rp

K8S_VERSION = "1.31"
TOKEN = "tok-" + "x" * 40


def plan(multi_node: bool = False, holds_rank0: bool = True, kind: str = "gpu") -> rp.PodPlan:
    ranks = [
        rp.RankContainer(
            rank=r,
            device=d,
            argv=["/usr/local/bin/python", "-m", "vigil_trainer", "--launch", rp.POD_LAUNCH_FILE],
            env={
                "RANK": str(r),
                "VIGIL_RANK_TOKEN": TOKEN,
                "GLOO_SOCKET_IFNAME": "eth0",
                "MASTER_ADDR": "10.0.0.9",
                "VIGIL_JOB_ID": "Job_42",
            },
        )
        for r, d in ((4, 2), (5, 3))
    ]
    return rp.PodPlan(
        job_id="Job_42", attempt=3, node="gpu-node-1", namespace="vigil-jobs", worker_namespace="vigil",
        image="vigil-worker:dev", uid=rp.job_uid("Job_42", 200_000), kind=kind, ranks=ranks,
        worker_address="10.1.2.3", relay_port=7611, checkpoint_dir="/var/lib/vigil/checkpoints/Job_42",
        checkpoint_claim="vigil-checkpoints", launch_json=json.dumps({"job_id": "Job_42"}),
        multi_node=multi_node, holds_rank0=holds_rank0, cpu="4", memory="16Gi",
    )  # fmt: skip


@pytest.mark.parametrize(("multi_node", "holds_rank0"), [(False, True), (True, True), (True, False)])
def test_every_object_matches_the_kubernetes_schemas(multi_node: bool, holds_rank0: bool) -> None:
    docs = rp.objects(plan(multi_node, holds_rank0))
    kinds = [d["kind"] for d in docs]
    assert kinds == [
        "ServiceAccount",
        "NetworkPolicy",
        *(["Service"] if multi_node and holds_rank0 else []),
        "Pod",
    ]
    for doc in docs:
        kubernetes_validate.validate(doc, K8S_VERSION, strict=True)
    broken = rp.rank_pod(plan())
    broken["spec"]["securityContext"]["runAsUsr"] = 1  # the schemas catch a misspelt field
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(broken, K8S_VERSION, strict=True)


def test_no_secret_and_no_token_anywhere_and_no_api_credential() -> None:
    for doc in rp.objects(plan(multi_node=True)):
        text = json.dumps(doc)
        assert TOKEN not in text and "VIGIL_RANK_TOKEN" not in text, doc["kind"]
        assert "secret" not in text.lower(), f"{doc['kind']}: a Secret reference"
    pod = rp.rank_pod(plan())
    spec = pod["spec"]
    assert spec["automountServiceAccountToken"] is False and spec["enableServiceLinks"] is False
    assert spec["serviceAccountName"] == rp.service_account(plan())["metadata"]["name"] != "default"
    assert rp.service_account(plan())["automountServiceAccountToken"] is False
    assert not any(k in spec for k in ("hostNetwork", "hostPID", "hostIPC", "shareProcessNamespace"))
    for volume in spec["volumes"]:
        assert set(volume) - {"name"} <= {"emptyDir", "downwardAPI", "persistentVolumeClaim"}, volume
    for c in spec["containers"]:
        env = {e["name"]: e for e in c["env"]}
        assert "envFrom" not in c and all("secretKeyRef" not in e.get("valueFrom", {}) for e in c["env"])
        assert env["VIGIL_AGENT_SOCKET"]["value"] == "tcp://10.1.2.3:7611"
        assert "GLOO_SOCKET_IFNAME" not in env  # the worker's interface is not the pod's


def test_the_pod_meets_the_restricted_pod_security_standard() -> None:
    pod = rp.rank_pod(plan())
    spec = pod["spec"]
    security = spec["securityContext"]
    assert security["runAsNonRoot"] is True and security["runAsUser"] == security["runAsGroup"] >= 200_000
    assert security["supplementalGroups"] == [] and "fsGroup" not in security
    assert security["seccompProfile"] == {"type": "RuntimeDefault"}
    assert spec["nodeName"] == "gpu-node-1" and spec["restartPolicy"] == "Never"
    for c in spec["containers"]:
        sc = c["securityContext"]
        assert sc["allowPrivilegeEscalation"] is False and sc["privileged"] is False
        assert sc["readOnlyRootFilesystem"] is True and sc["capabilities"] == {"drop": ["ALL"]}


def test_one_container_per_rank_on_its_placed_device_with_the_limits_and_labels() -> None:
    pod = rp.rank_pod(plan())
    labels = pod["metadata"]["labels"]
    assert labels[rp.LABEL_ATTEMPT] == "3" and labels[rp.LABEL_NODE] == "gpu-node-1"
    assert labels[rp.LABEL_JOB] == "Job_42" and labels["app.kubernetes.io/component"] == "rank"
    assert pod["metadata"]["annotations"][rp.ANNOTATION_JOB_ID] == "Job_42"
    assert json.loads(pod["metadata"]["annotations"][rp.ANNOTATION_LAUNCH]) == {"job_id": "Job_42"}
    containers = pod["spec"]["containers"]
    assert [c["name"] for c in containers] == ["rank-4", "rank-5"]
    for c, device in zip(containers, (2, 3), strict=True):
        env = {e["name"]: e.get("value") for e in c["env"]}
        assert (env["NVIDIA_VISIBLE_DEVICES"], env["CUDA_VISIBLE_DEVICES"]) == (str(device), "0")
        assert env["MASTER_ADDR"] == "127.0.0.1"  # one node: the pod's ranks share its network
        limits = {"cpu": "4", "memory": "16Gi", "ephemeral-storage": "10Gi"}
        assert c["resources"] == {"requests": limits, "limits": limits}
        (checkpoints,) = [m for m in c["volumeMounts"] if m["name"] == "checkpoints"]
        assert checkpoints == {"name": "checkpoints", "mountPath": "/var/lib/vigil/checkpoints/Job_42",
                               "subPath": "Job_42"}  # fmt: skip
    cpu = rp.rank_pod(plan(kind="cpu"))["spec"]["containers"][0]
    assert {e["name"]: e.get("value") for e in cpu["env"]}["NVIDIA_VISIBLE_DEVICES"] == "void"


def test_the_job_cannot_choose_its_device_or_agent_through_its_env() -> None:
    p = plan()
    hostile = rp.RankContainer(
        0, 1, ["x"], {"NVIDIA_VISIBLE_DEVICES": "all", "VIGIL_AGENT_SOCKET": "tcp://nats:4222"}
    )
    env = {e["name"]: e.get("value") for e in rp.rank_env(p, hostile)}
    assert env["NVIDIA_VISIBLE_DEVICES"] == "1" and env["VIGIL_AGENT_SOCKET"] == "tcp://10.1.2.3:7611"


def test_the_network_policy_admits_the_jobs_pods_and_reaches_only_them_and_the_relay() -> None:
    policy = rp.network_policy(plan())["spec"]
    job = {"podSelector": {"matchLabels": {rp.LABEL_JOB: "Job_42"}}}
    assert policy["podSelector"]["matchLabels"] == {rp.LABEL_JOB: "Job_42", rp.LABEL_NODE: "gpu-node-1"}
    assert policy["policyTypes"] == ["Ingress", "Egress"]
    assert policy["ingress"] == [{"from": [job]}]
    relay, peers = policy["egress"]
    assert relay["ports"] == [{"protocol": "TCP", "port": 7611}]
    assert relay["to"][0]["podSelector"] == {"matchLabels": {"app.kubernetes.io/name": "vigil-worker"}}
    assert relay["to"][0]["namespaceSelector"] == {"matchLabels": {"kubernetes.io/metadata.name": "vigil"}}
    assert peers == {"to": [job]}
    multi = rp.network_policy(plan(multi_node=True))["spec"]["egress"]
    assert len(multi) == 3 and {p["port"] for p in multi[2]["ports"]} == {53}  # the rendezvous name


def test_a_job_spanning_nodes_rendezvous_at_rank_0s_pod() -> None:
    rank0 = {e["name"]: e for e in rp.rank_pod(plan(True, True))["spec"]["containers"][0]["env"]}
    other = {e["name"]: e for e in rp.rank_pod(plan(True, False))["spec"]["containers"][0]["env"]}
    assert rank0["MASTER_ADDR"]["valueFrom"] == {"fieldRef": {"fieldPath": "status.podIP"}}
    service = rp.rendezvous_service(plan(True, True))
    assert other["MASTER_ADDR"]["value"] == f"{service['metadata']['name']}.vigil-jobs.svc"
    assert service["spec"]["clusterIP"] == "None" and service["spec"]["publishNotReadyAddresses"] is True
    assert service["spec"]["selector"] == rp.network_policy(plan())["spec"]["podSelector"]["matchLabels"]


def test_names_are_dns_labels_distinct_per_job_and_uids_per_job() -> None:
    a, b = rp.pod_name("Job_42", 1, "n" * 60), rp.pod_name("job-42", 1, "n" * 60)
    assert a != b and len(a) <= 63 and re.fullmatch(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?", a)
    assert rp.label_value("x" * 64).startswith("h-") and len(rp.label_value("x" * 64)) <= 63
    assert rp.job_uid("a", 200_000) != rp.job_uid("b", 200_000)
    assert 200_000 <= rp.job_uid("a", 200_000) < 200_000 + rp.UID_SPAN
