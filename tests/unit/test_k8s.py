"""deploy/k8s, checked where no cluster runs: each overlay rendered as `kubectl kustomize` would (the
subset of kustomize the manifests use: resources, namespace, labels, images, strategic-merge patches),
every object validated against the Kubernetes schemas (kubernetes-validate, strict), and checked like
compose.yaml: every Vigil container runs a real `vigil` command with real settings, probes that its
service serves, secrets and volumes that exist, selectors that select, network policies that let each pod
reach what it connects to, a NATS config that nats-server accepts, with one user per role
(credentials.py's) and each container connecting as its own."""

from __future__ import annotations

import copy
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import kubernetes_validate
import pytest
import yaml

from tests.unit.deploy_checks import (
    assert_connects_as,
    assert_users_are_credentials_roles,
    assert_vigil_command,
    nats_authorization,
    nats_server,
    service_role,
    settings_from,
    unknown_settings,
)
from vigil_common.settings import Settings

K8S = Path(__file__).resolve().parents[2] / "deploy" / "k8s"
OVERLAYS = ("cpu", "gpu")
KUBERNETES_VERSION = "1.31"
VIGIL_IMAGES = ("vigil", "vigil-worker")
CLUSTER_SCOPED = {"Namespace", "PersistentVolume", "ClusterRole", "ClusterRoleBinding", "StorageClass"}
WORKLOADS = ("Deployment", "StatefulSet", "DaemonSet")
AUTHORIZATION = nats_authorization()
K8S_NODES = AUTHORIZATION.k8s_nodes(AUTHORIZATION.K8S_FILE.read_text())  # the listed worker nodes

Doc = dict[str, Any]


# --- a small kustomize -------------------------------------------------------------------------------


def render(folder: Path) -> list[Doc]:
    """The objects `kubectl kustomize folder` prints, for the features deploy/k8s uses."""
    kustomization = yaml.safe_load((folder / "kustomization.yaml").read_text())
    unknown = set(kustomization) - {
        "apiVersion",
        "kind",
        "namespace",
        "labels",
        "resources",
        "patches",
        "images",
    }
    assert not unknown, f"{folder}: this renderer does not know {sorted(unknown)}"
    docs: list[Doc] = []
    for entry in kustomization.get("resources", []):
        path = folder / entry
        if path.is_dir():
            docs += render(path)
        else:
            docs += [d for d in yaml.safe_load_all(path.read_text()) if d]
    for patch in kustomization.get("patches", []):
        change = yaml.safe_load((folder / patch["path"]).read_text())
        (target,) = [d for d in docs if _key(d) == _key(change)] or [None]
        assert target is not None, f"{folder}/{patch['path']}: no {_key(change)} to patch"
        docs[docs.index(target)] = strategic_merge(target, change)
    for doc in docs:
        if "namespace" in kustomization and doc["kind"] not in CLUSTER_SCOPED:
            doc["metadata"]["namespace"] = kustomization["namespace"]
        for label_set in kustomization.get("labels", []):
            assert set(label_set) <= {"pairs", "includeTemplates"}, f"{folder}: this renderer: {label_set}"
            targets = [doc, *(_templates(doc) if label_set.get("includeTemplates") else [])]
            for target in targets:  # never the selectors: that is includeSelectors
                target.setdefault("metadata", {}).setdefault("labels", {}).update(label_set["pairs"])
        for image in kustomization.get("images", []):
            for container in _containers(doc):
                name, _, tag = container["image"].partition(":")
                if name == image["name"]:
                    container["image"] = f"{image.get('newName', name)}:{image.get('newTag', tag)}"
    return docs


def _templates(doc: Doc) -> list[Doc]:
    """The templates whose metadata.labels kustomize's `labels` with includeTemplates also labels (its
    metadataLabelsFieldSpecs, created where missing): the pod templates of the workloads, the job template
    of a CronJob, and a StatefulSet's volume claim templates."""
    if doc["kind"] in {
        "Deployment",
        "ReplicaSet",
        "DaemonSet",
        "StatefulSet",
        "Job",
        "ReplicationController",
    }:
        spec = doc.setdefault("spec", {})
        return [spec.setdefault("template", {}), *spec.get("volumeClaimTemplates", [])]
    if doc["kind"] == "CronJob":
        job = doc.setdefault("spec", {}).setdefault("jobTemplate", {})
        return [job, job.setdefault("spec", {}).setdefault("template", {})]
    return []


def _key(doc: Doc) -> tuple[str, str]:
    return doc["kind"], doc["metadata"]["name"]


def strategic_merge(base: Any, patch: Any) -> Any:
    """Maps merge key by key; lists of named items (containers, env, volumes, ...) merge by name, in
    kustomize's order; other lists are replaced. (The last test compares with `kubectl kustomize`.)"""
    if isinstance(base, dict) and isinstance(patch, dict):
        out = copy.deepcopy(base)
        for key, value in patch.items():
            out[key] = strategic_merge(base[key], value) if key in base else copy.deepcopy(value)
        return out
    if (
        isinstance(base, list)
        and isinstance(patch, list)
        and all(isinstance(i, dict) and "name" in i for i in patch)
    ):
        # as kustomize orders them: the patch's items (merged into the base's), then the base's others
        by_name = {item.get("name"): item for item in base if isinstance(item, dict)}
        merged = [strategic_merge(by_name[i["name"]], i) if i["name"] in by_name else i for i in patch]
        named = {i["name"] for i in patch}
        rest = [item for item in base if not (isinstance(item, dict) and item.get("name") in named)]
        return copy.deepcopy(merged) + copy.deepcopy(rest)
    return copy.deepcopy(patch)


def _pod(doc: Doc) -> Doc:
    return doc["spec"]["template"]["spec"] if doc["kind"] in WORKLOADS else {}


def _containers(doc: Doc) -> list[Doc]:
    pod = _pod(doc)
    return [*pod.get("initContainers", []), *pod.get("containers", [])]


def _vigil_containers(docs: list[Doc]) -> list[tuple[Doc, Doc]]:
    return [
        (doc, c) for doc in docs for c in _containers(doc) if c["image"].partition(":")[0] in VIGIL_IMAGES
    ]


def _of(docs: list[Doc], kind: str, name: str | None = None) -> list[Doc]:
    return [d for d in docs if d["kind"] == kind and name in (None, d["metadata"]["name"])]


@pytest.fixture(
    scope="module", params=OVERLAYS, ids=[f"{o}-overlay" for o in OVERLAYS]
)  # not "gpu": a marker
def overlay(request: pytest.FixtureRequest) -> tuple[str, list[Doc]]:
    return request.param, render(K8S / "overlays" / request.param)


# --- the renderer itself -----------------------------------------------------------------------------


def test_strategic_merge_merges_named_items_and_replaces_other_lists() -> None:
    base = {"containers": [{"name": "a", "env": [{"name": "X", "value": "1"}], "args": ["x"]}], "n": 1}
    patch = {
        "containers": [{"name": "a", "env": [{"name": "Y", "value": "2"}], "args": ["y"]}, {"name": "b"}]
    }
    assert strategic_merge(base, patch) == {
        "containers": [
            {"name": "a", "env": [{"name": "Y", "value": "2"}, {"name": "X", "value": "1"}], "args": ["y"]},
            {"name": "b"},
        ],
        "n": 1,
    }


def test_labels_with_include_templates_label_the_templates_but_not_the_selectors(tmp_path: Path) -> None:
    deployment = {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": "d"},
        "spec": {"selector": {"matchLabels": {"x": "y"}}, "template": {"metadata": {"labels": {"x": "y"}}}},
    }
    job = {"apiVersion": "batch/v1", "kind": "Job", "metadata": {"name": "j"}, "spec": {"template": {}}}
    (tmp_path / "r.yaml").write_text(yaml.safe_dump_all([deployment, job]))
    pairs = {"part-of": "v"}
    for include, pod_labels in ((False, {"x": "y"}), (True, {"x": "y", **pairs})):
        (tmp_path / "kustomization.yaml").write_text(
            yaml.safe_dump(
                {"labels": [{"pairs": pairs, "includeTemplates": include}], "resources": ["r.yaml"]}
            )
        )
        d, j = render(tmp_path)
        assert d["metadata"]["labels"] == j["metadata"]["labels"] == pairs
        assert d["spec"]["selector"] == {"matchLabels": {"x": "y"}}
        assert d["spec"]["template"]["metadata"]["labels"] == pod_labels
        assert j["spec"]["template"].get("metadata", {}).get("labels") == (pairs if include else None)


# --- the manifests -----------------------------------------------------------------------------------


def test_every_object_matches_the_kubernetes_schemas(overlay: tuple[str, list[Doc]]) -> None:
    name, docs = overlay
    errors = []
    for doc in docs:
        try:
            kubernetes_validate.validate(doc, KUBERNETES_VERSION, strict=True)
        except kubernetes_validate.ValidationError as exc:
            errors.append(f"{_key(doc)}: {'/'.join(map(str, exc.path))}: {exc.message}")
    assert not errors, f"overlay {name}:\n" + "\n".join(errors)
    assert len({_key(d) for d in docs}) == len(docs), "an object appears twice"


def test_the_schemas_catch_mistakes(overlay: tuple[str, list[Doc]]) -> None:
    _, docs = overlay
    broken = copy.deepcopy(_of(docs, "Deployment", "vigil-scheduler")[0])
    broken["spec"]["template"]["spec"]["containers"][0]["readinessProbe"]["httpGet"]["prot"] = 8000
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(broken, KUBERNETES_VERSION, strict=True)


def test_every_vigil_container_runs_a_real_command_with_real_settings(
    overlay: tuple[str, list[Doc]], monkeypatch: pytest.MonkeyPatch
) -> None:
    _, docs = overlay
    commands = []
    for doc, container in _vigil_containers(docs):
        assert "command" not in container, "the image's entry point is `vigil`: give the command as args"
        assert_vigil_command(container["args"])
        commands.append(container["args"][0])
        env = _env(docs, doc, container)
        assert not unknown_settings(list(env)), f"{_key(doc)}: not settings: {unknown_settings(list(env))}"
        settings = settings_from({k: v for k, v in env.items() if k.startswith("VIGIL_")}, monkeypatch)
        assert settings.nats_url and urlsplit(settings.nats_url).hostname == "nats", _key(doc)
        nats_servers = _of(docs, "StatefulSet", "nats")[0]["spec"]["replicas"]
        assert settings.stream_replicas == nats_servers, f"{_key(doc)}: VIGIL_STREAM_REPLICAS"
        if container["args"][0] != "worker":
            assert settings.database_url, _key(doc)
    assert sorted(commands) == ["guardian", "scheduler", "telemetry", "worker"]


def _env(docs: list[Doc], doc: Doc, container: Doc) -> dict[str, str]:
    """A container's environment as Kubernetes builds it: in order, each `$(NAME)` replaced by a variable
    defined above it (one defined later, or not at all, stays as written)."""
    secrets = {k: v for s in _of(docs, "Secret") for k, v in s["stringData"].items()}
    env: dict[str, str] = {}
    for entry in container.get("env", []):
        value = _value(entry, secrets, doc)
        env[entry["name"]] = re.sub(r"\$\((\w+)\)", lambda m: env.get(m.group(1), m.group(0)), value)
    return env


def _value(entry: Doc, secrets: dict[str, str], doc: Doc) -> str:
    """An env entry's value, from the example Secret or a stand-in for the downward API."""
    if "value" in entry:
        return str(entry["value"])
    source = entry["valueFrom"]
    if "secretKeyRef" in source:
        ref = source["secretKeyRef"]
        assert ref["name"] == "vigil-secrets" and ref["key"] in secrets, (_key(doc), ref)
        return secrets[ref["key"]]
    field = source["fieldRef"]["fieldPath"]
    return {"spec.nodeName": K8S_NODES[0], "status.podIP": "10.1.2.3", "metadata.name": "pod-0"}[field]


def test_each_container_connects_as_its_own_nats_user(overlay: tuple[str, list[Doc]]) -> None:
    """Users and permissions are credentials.py's; each container's URL has its own user and the
    password the NATS servers give that user, ranks get none, no service admin's."""
    _, docs = overlay
    (nats,) = _of(docs, "StatefulSet", "nats")
    (server,) = _containers(nats)
    nats_env = {k: v for k, v in _env(docs, nats, server).items() if k.endswith("_PASSWORD")}
    (config_map,) = _of(docs, "ConfigMap", "nats-authorization")
    variables = assert_users_are_credentials_roles(config_map["data"]["authorization.conf"], K8S_NODES)
    assert sorted(nats_env) == sorted(set(variables.values())), "each password the users read, no other"
    assert len(set(nats_env.values())) == len(nats_env), "secrets.yaml: one password per variable"
    password = {user: nats_env[variable] for user, variable in variables.items()}
    for doc, c in _vigil_containers(docs):
        env = _env(docs, doc, c)
        role = service_role(c["args"][0], env.get("VIGIL_NODE_NAME"))
        assert_connects_as(env["VIGIL_NATS_URL"], role, password[role])
        assert "VIGIL_RANK_NATS_URL" not in env, _key(doc)  # ranks hold no bus credential


def test_probes_ask_what_each_service_serves(overlay: tuple[str, list[Doc]]) -> None:
    _, docs = overlay
    for doc, c in _vigil_containers(docs):
        ports = {p["name"]: p["containerPort"] for p in c.get("ports", [])}
        env = {e["name"]: e.get("value") for e in c.get("env", [])}
        probes = {k: c[k] for k in ("startupProbe", "livenessProbe", "readinessProbe") if k in c}
        assert "livenessProbe" in probes, _key(doc)
        for kind, probe in probes.items():
            if "httpGet" in probe:
                port = ports[probe["httpGet"]["port"]]
                path = probe["httpGet"]["path"]
                if c["args"][0] == "scheduler":  # the gateway: /healthz live, /readyz ready
                    assert port == int(env["VIGIL_HTTP_PORT"])
                    assert path == ("/readyz" if kind == "readinessProbe" else "/healthz")
                else:  # telemetry's only HTTP is /metrics
                    assert (c["args"][0], port, path) == (
                        "telemetry",
                        int(env["VIGIL_METRICS_PORT"]),
                        "/metrics",
                    )
                    assert env["VIGIL_HTTP_HOST"] == "0.0.0.0"
            else:
                assert probe["exec"]["command"] == ["vigil-healthcheck", "bus", c["args"][0]], _key(doc)


def test_services_and_policies_select_pods_and_volumes_exist(overlay: tuple[str, list[Doc]]) -> None:
    _, docs = overlay
    pods = {_key(d): d["spec"]["template"]["metadata"]["labels"] for d in docs if d["kind"] in WORKLOADS}

    def selects(selector: dict[str, str]) -> list[tuple[str, str]]:
        return [k for k, labels in pods.items() if selector.items() <= labels.items()]

    for workload in (d for d in docs if d["kind"] in WORKLOADS):
        assert selects(workload["spec"]["selector"]["matchLabels"]) == [_key(workload)]
        pod = _pod(workload)
        volumes = {v["name"]: v for v in pod.get("volumes", [])}
        claims = {t["metadata"]["name"] for t in workload["spec"].get("volumeClaimTemplates", [])}
        for c in _containers(workload):
            for mount in c.get("volumeMounts", []):
                assert mount["name"] in volumes or mount["name"] in claims, (_key(workload), mount["name"])
        for v in volumes.values():
            if "persistentVolumeClaim" in v:
                assert _of(docs, "PersistentVolumeClaim", v["persistentVolumeClaim"]["claimName"])
            for source in [v, *v.get("projected", {}).get("sources", [])]:
                if "configMap" in source:
                    assert _of(docs, "ConfigMap", source["configMap"]["name"]), source["configMap"]["name"]
    for service in _of(docs, "Service"):
        (target,) = selects(service["spec"]["selector"]) or [None]
        assert target is not None, service["metadata"]["name"]
    policies = _of(docs, "NetworkPolicy")
    assert any(p["spec"]["podSelector"] == {} and "ingress" not in p["spec"] for p in policies), (
        "default deny"
    )
    for policy in policies:
        selector = policy["spec"]["podSelector"].get("matchLabels", {})
        assert selects(selector), policy["metadata"]["name"]
    reached = {
        k
        for p in policies
        if p["spec"].get("ingress")
        for k in selects(p["spec"]["podSelector"]["matchLabels"])
    }
    assert reached >= {
        ("StatefulSet", "nats"),
        ("Deployment", "vigil-scheduler"),
        ("Deployment", "vigil-telemetry"),
    }
    assert ("DaemonSet", "vigil-worker") in reached  # ranks reach ranks


def _selects(selector: Doc, labels: dict[str, str]) -> bool:
    assert not selector.get("matchExpressions"), "this check knows matchLabels only"
    return selector.get("matchLabels", {}).items() <= labels.items()


def _pod_labels(workload: Doc) -> dict[str, str]:
    return workload["spec"]["template"].get("metadata", {}).get("labels", {})


def _admits(docs: list[Doc], source: Doc, target: Doc, port: int | str) -> bool:
    """Whether the render's NetworkPolicies let source's pods reach target's pods on port (a container
    port's number or name), as a cluster enforcing them would: pods no policy selects take anything; the
    others what some rule of a policy selecting them lets in (its peers, its ports; a peer with an
    ipBlock is taken to be no pod)."""
    ports = {p["containerPort"]: p.get("name") for c in _containers(target) for p in c.get("ports", [])}
    number = port if isinstance(port, int) else next((n for n, name in ports.items() if name == port), None)
    namespace = {"kubernetes.io/metadata.name": source["metadata"].get("namespace", "")}
    policies = [
        p for p in _of(docs, "NetworkPolicy") if _selects(p["spec"]["podSelector"], _pod_labels(target))
    ]
    if not any("Ingress" in p["spec"].get("policyTypes", ["Ingress"]) for p in policies):
        return True

    def peer_admits(peer: Doc) -> bool:
        return (
            "ipBlock" not in peer
            and _selects(peer.get("podSelector", {}), _pod_labels(source))
            and _selects(peer.get("namespaceSelector", {}), namespace)
        )

    def port_admits(rule_port: Doc) -> bool:
        if "port" not in rule_port:
            return True
        want = rule_port["port"]
        if isinstance(want, str):
            return want == port or (number is not None and ports.get(number) == want)
        return number is not None and want <= number <= rule_port.get("endPort", want)

    return any(
        (not rule.get("from") or any(peer_admits(peer) for peer in rule["from"]))
        and (not rule.get("ports") or any(port_admits(p) for p in rule["ports"]))
        for policy in policies
        for rule in policy["spec"].get("ingress", [])
    )


def test_network_policies_let_vigils_pods_reach_what_they_connect_to(overlay: tuple[str, list[Doc]]) -> None:
    """Under the default deny, every policy rule's pod selector selects some pod of the render, and each
    workload that connects to NATS (VIGIL_NATS_URL) is let in on the port its Service sends the URL's port
    to: by the `nats` policy's client rule; NATS servers reach each other's routes, ranks reach ranks."""
    _, docs = overlay
    workloads = [d for d in docs if d["kind"] in WORKLOADS] + [rank_pod_as_workload(docs)]
    for policy in _of(docs, "NetworkPolicy"):
        for rule in policy["spec"].get("ingress", []):
            for peer in rule.get("from", []):
                if "podSelector" in peer:
                    assert any(_selects(peer["podSelector"], _pod_labels(w)) for w in workloads), (
                        f"NetworkPolicy {policy['metadata']['name']}: {peer['podSelector']} selects no pod"
                    )
    (nats_policy,) = _of(docs, "NetworkPolicy", "nats")
    (client_rule,) = [r for r in nats_policy["spec"]["ingress"] if {"port": 4222} in r.get("ports", [])]
    clients = set()
    for doc, container in _vigil_containers(docs):
        url = urlsplit(_env(docs, doc, container)["VIGIL_NATS_URL"])
        (service,) = _of(docs, "Service", url.hostname)
        (service_port,) = [p for p in service["spec"]["ports"] if p["port"] == url.port]
        (server,) = [
            w for w in workloads if _selects({"matchLabels": service["spec"]["selector"]}, _pod_labels(w))
        ]
        target_port = service_port.get("targetPort", service_port["port"])
        assert _admits(docs, doc, server, target_port), f"{_key(doc)} cannot reach {url.hostname}:{url.port}"
        assert any(_selects(peer["podSelector"], _pod_labels(doc)) for peer in client_rule["from"]), _key(doc)
        clients.add(_key(doc))
    assert {k[1] for k in clients} == {"vigil-scheduler", "vigil-telemetry", "vigil-guardian", "vigil-worker"}
    (nats,) = _of(docs, "StatefulSet", "nats")
    assert _admits(docs, nats, nats, "cluster")
    (worker,) = _of(docs, "DaemonSet", "vigil-worker")
    assert _admits(docs, worker, worker, 29500)  # the rendezvous's port, and any other
    (scheduler,) = _of(docs, "Deployment", "vigil-scheduler")
    assert not _admits(docs, scheduler, worker, 29500), "workers only: the policies check something"
    ranks = rank_pod_as_workload(docs)
    assert _admits(docs, ranks, worker, "relay"), "a rank pod reaches its worker's relay"
    assert not _admits(docs, ranks, worker, 29500) and not _admits(docs, ranks, nats, 4222)
    assert not _admits(docs, scheduler, worker, "relay")


def _worker_settings(docs: list[Doc]) -> dict[str, str]:
    (worker,) = _of(docs, "DaemonSet", "vigil-worker")
    (container,) = _pod(worker)["containers"]
    return {k: v for k, v in _env(docs, worker, container).items() if k.startswith("VIGIL_")}


CLAIM = Settings.model_fields["rank_checkpoint_claim"].default  # the rank pods' checkpoint claim


def rank_pod_as_workload(docs: list[Doc]) -> Doc:
    """A rank pod as the worker of this render makes it (vigil_worker.rank_pod), in a workload's shape."""
    from vigil_worker import rank_pod as rp

    env = _worker_settings(docs)
    plan = rp.PodPlan(
        job_id="j-1", attempt=1, node=K8S_NODES[0], namespace=env["VIGIL_RANK_NAMESPACE"],
        worker_namespace="vigil", image=env["VIGIL_RANK_IMAGE"], uid=200_001, kind="cpu",
        ranks=[rp.RankContainer(0, 0, ["python"], {})], worker_address="10.1.2.3",
        relay_port=int(env["VIGIL_RELAY_PORT"]), checkpoint_dir="/var/lib/vigil/checkpoints/j-1",
        checkpoint_claim=env.get("VIGIL_RANK_CHECKPOINT_CLAIM", CLAIM), launch_json="{}", multi_node=False, holds_rank0=True,
    )  # fmt: skip
    pod = rp.rank_pod(plan)
    return {
        "kind": "Pod",
        "metadata": {"name": pod["metadata"]["name"], "namespace": plan.namespace},
        "spec": {"template": {"metadata": {"labels": pod["metadata"]["labels"]}, "spec": pod["spec"]}},
    }


def test_the_workers_run_ranks_as_pods_in_a_namespace_of_their_own(overlay: tuple[str, list[Doc]]) -> None:
    """VIGIL_RANK_RUNTIME=kubernetes; the rank namespace enforces the restricted Pod Security Standard,
    denies all traffic but what a job's own policy lets, holds no Secret; the workers' ServiceAccount may
    make pods, ServiceAccounts, Services and NetworkPolicies there and nothing else anywhere."""
    name, docs = overlay
    env = _worker_settings(docs)
    (worker,) = _of(docs, "DaemonSet", "vigil-worker")
    (container,) = _pod(worker)["containers"]
    assert env["VIGIL_RANK_RUNTIME"] == "kubernetes"
    assert env["VIGIL_RANK_IMAGE"] == container["image"], "the rank pods run the worker's own image"
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert ports["relay"] == int(env["VIGIL_RELAY_PORT"])
    jobs = env["VIGIL_RANK_NAMESPACE"]
    (namespace,) = _of(docs, "Namespace", jobs)
    assert namespace["metadata"]["labels"]["pod-security.kubernetes.io/enforce"] == "restricted"
    in_jobs = [d for d in docs if d["metadata"].get("namespace") == jobs]
    assert not [d for d in in_jobs if d["kind"] in ("Secret", "ConfigMap", *WORKLOADS)], "nothing to mount"
    (deny,) = [p for p in _of(docs, "NetworkPolicy") if p["metadata"]["namespace"] == jobs]
    assert deny["spec"] == {"podSelector": {}, "policyTypes": ["Ingress", "Egress"]}
    assert _of(docs, "PersistentVolumeClaim", "vigil-rank-checkpoints")[0]["metadata"]["namespace"] == jobs
    # the worker's identity: its own ServiceAccount, bound to one Role, in the rank namespace only
    sa = _pod(worker)["serviceAccountName"]
    assert _of(docs, "ServiceAccount", sa)[0]["metadata"]["namespace"] == worker["metadata"]["namespace"]
    assert not _of(docs, "ClusterRole") and not _of(docs, "ClusterRoleBinding")
    (binding,) = _of(docs, "RoleBinding")
    assert binding["metadata"]["namespace"] == jobs
    assert binding["subjects"] == [
        {"kind": "ServiceAccount", "name": sa, "namespace": worker["metadata"]["namespace"]}
    ]
    (role,) = _of(docs, "Role", binding["roleRef"]["name"])
    assert role["metadata"]["namespace"] == jobs
    granted = {(g, r, v) for rule in role["rules"] for g in rule["apiGroups"] for r in rule["resources"]
               for v in rule["verbs"]}  # fmt: skip
    crud = ("create", "get", "list", "watch", "delete")
    assert granted == {
        *(("", r, v) for r in ("pods", "serviceaccounts", "services") for v in crud),
        ("", "pods/log", "get"),
        *(("networking.k8s.io", "networkpolicies", v) for v in crud),
    }, f"overlay {name}: no secrets, no bindings, no escalation"
    # what the worker makes there is valid and admitted by this namespace's rules
    pod = rank_pod_as_workload(docs)
    assert pod["spec"]["template"]["spec"]["volumes"][-1]["persistentVolumeClaim"]["claimName"] in {
        c["metadata"]["name"] for c in in_jobs if c["kind"] == "PersistentVolumeClaim"
    }


@pytest.mark.parametrize("name", ["vigil-scheduler", "vigil-guardian"])
def test_two_schedulers_and_two_guardians_with_a_disruption_budget(
    overlay: tuple[str, list[Doc]], name: str
) -> None:
    """One active, one standing by (vigil_common.lease); a drain never takes both."""
    _, docs = overlay
    (deployment,) = _of(docs, "Deployment", name)
    assert deployment["spec"]["replicas"] == 2 and deployment["spec"]["strategy"]["type"] == "RollingUpdate"
    (budget,) = _of(docs, "PodDisruptionBudget", name)
    assert budget["spec"]["minAvailable"] == 1
    assert budget["spec"]["selector"]["matchLabels"] == deployment["spec"]["selector"]["matchLabels"]


def test_nats_is_three_clustered_jetstream_servers_on_their_own_volumes(
    overlay: tuple[str, list[Doc]], tmp_path: Path
) -> None:
    _, docs = overlay
    (nats,) = _of(docs, "StatefulSet", "nats")
    assert nats["spec"]["replicas"] == 3
    (claim,) = nats["spec"]["volumeClaimTemplates"]
    (container,) = _pod(nats)["containers"]
    mounts = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}
    config_text = _of(docs, "ConfigMap", "nats-config")[0]["data"]["nats.conf"]
    store = re.search(r'store_dir:\s*"([^"]+)"', config_text).group(1)  # type: ignore[union-attr]
    assert store.startswith(mounts[claim["metadata"]["name"]] + "/"), "JetStream's files live on the volume"
    routes = re.findall(r'"nats://([^":]+):(\d+)"', config_text)
    headless = _of(docs, "Service", nats["spec"]["serviceName"])[0]
    assert headless["spec"]["clusterIP"] == "None"
    assert sorted(routes) == [(f"nats-{i}.{headless['metadata']['name']}", "6222") for i in range(3)]
    # the config volume as the pod sees it: every file of its ConfigMaps in one folder
    (volume,) = [v for v in _pod(nats)["volumes"] if v["name"] == "config"]
    assert container["args"] == ["--config", f"{mounts['config']}/nats.conf"]
    for source in volume["projected"]["sources"]:
        for name, text in _of(docs, "ConfigMap", source["configMap"]["name"])[0]["data"].items():
            (tmp_path / name).write_text(text)
    assert re.search(r'^include "authorization.conf"$', config_text, re.M)
    env = _env(docs, nats, container)
    check = subprocess.run(
        [nats_server(), "-c", str(tmp_path / "nats.conf"), "-t"], env=env, capture_output=True, timeout=30
    )
    assert check.returncode == 0, check.stderr.decode()


def test_gpu_workers_ask_for_nvidia_gpus_and_cpu_workers_do_not(overlay: tuple[str, list[Doc]]) -> None:
    name, docs = overlay
    (worker,) = _of(docs, "DaemonSet", "vigil-worker")
    (container,) = _pod(worker)["containers"]
    limits = container["resources"].get("limits", {})
    env = {e["name"]: e.get("value") for e in container["env"]}
    if name == "gpu":
        assert int(limits["nvidia.com/gpu"]) >= 1
        assert _pod(worker)["nodeSelector"] == {"nvidia.com/gpu.present": "true"}
        assert container["image"] == "vigil-worker:dev-gpu" and env["VIGIL_GPU_BACKEND"] == "nvml"
    else:
        assert "nvidia.com/gpu" not in limits and "nodeSelector" not in _pod(worker)
        assert env["VIGIL_GPU_BACKEND"] == "cpu"


@pytest.mark.skipif(
    shutil.which("kubectl") is None, reason="kubectl not installed: the renderer is checked by hand"
)
def test_the_renderer_agrees_with_kubectl_kustomize(overlay: tuple[str, list[Doc]]) -> None:
    name, docs = overlay
    out = subprocess.run(
        ["kubectl", "kustomize", str(K8S / "overlays" / name)], capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stderr
    theirs = [d for d in yaml.safe_load_all(out.stdout) if d]
    assert sorted(docs, key=_key) == sorted(theirs, key=_key)
