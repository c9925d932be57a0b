"""compose.yaml, the Dockerfile and deploy/, checked where no Docker engine runs.

compose.yaml is interpolated the way Compose does it (with deploy/env.example as `.env`) and
validated against the Compose Specification schema (tests/unit/fixtures/compose_spec.json; its
source and licence are in fixtures/README.md). Every Vigil service's command must be a real
`vigil` command, every `VIGIL_*` variable a real setting with a valid value, every dependency a
real service, and the NATS config must be accepted by the real nats-server, with one user per role
(credentials.py's) and each service connecting as its own.
"""

from __future__ import annotations

import copy
import importlib.util
import json
import os
import re
import shutil
import socket
import subprocess
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from types import ModuleType
from typing import Any
from urllib.parse import urlsplit

import pytest
import yaml
from jsonschema import Draft201909Validator

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
from vigil_common import credentials

ROOT = Path(__file__).resolve().parents[2]
COMPOSE_FILE = ROOT / "compose.yaml"
DEPLOY = ROOT / "deploy"
SCHEMA_FILE = Path(__file__).parent / "fixtures" / "compose_spec.json"
AUTHORIZATION = nats_authorization()
NATS_PASSWORDS = {AUTHORIZATION.password_variable(r) for r in credentials.roles(AUTHORIZATION.COMPOSE_NODES)}
SECRETS = {"POSTGRES_PASSWORD", "VIGIL_API_TOKEN", "GRAFANA_ADMIN_PASSWORD", *NATS_PASSWORDS}
INFRA_HEALTHCHECKED = ("nats", "postgres", "prometheus")

# Compose interpolation: `$$` escapes a dollar; `${VAR}`, `${VAR:-default}`, `${VAR-default}`,
# `${VAR:?error}`, `${VAR?error}` and `$VAR`.
_VAR = re.compile(r"\$\$|\$\{([A-Za-z_][A-Za-z0-9_]*)(?:(:?[-?])([^}]*))?\}|\$([A-Za-z_][A-Za-z0-9_]*)")


class MissingVariable(ValueError):
    pass


def interpolate(value: Any, env: dict[str, str]) -> Any:
    if isinstance(value, dict):
        return {key: interpolate(item, env) for key, item in value.items()}
    if isinstance(value, list):
        return [interpolate(item, env) for item in value]
    if not isinstance(value, str):
        return value

    def substitute(match: re.Match[str]) -> str:
        if match.group(0) == "$$":
            return "$"
        name, op, arg = match.group(1) or match.group(4), match.group(2), match.group(3)
        if op in (":?", "?") and (name not in env or (op == ":?" and not env[name])):
            raise MissingVariable(f"{name}: {arg}")
        if op == ":-":
            return env.get(name) or arg
        if op == "-":
            return env.get(name, arg)
        return env.get(name, "")

    return _VAR.sub(substitute, value)


def env_example() -> dict[str, str]:
    pairs = {}
    for line in (DEPLOY / "env.example").read_text().splitlines():
        if line.strip() and not line.lstrip().startswith("#"):
            key, _, value = line.partition("=")
            pairs[key.strip()] = value.strip()
    return pairs


RAW: dict[str, Any] = yaml.safe_load(COMPOSE_FILE.read_text())
VIGIL_SERVICES = sorted(name for name, svc in RAW["services"].items() if "build" in svc)


@pytest.fixture(scope="module")
def compose() -> dict[str, Any]:
    return interpolate(RAW, env_example())


@pytest.fixture(scope="module")
def services(compose: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return compose["services"]


def schema_errors(document: dict[str, Any]) -> list[str]:
    schema = json.loads(SCHEMA_FILE.read_text())
    validator = Draft201909Validator(schema)  # the draft its $schema names (spelled the old way)
    return sorted(
        f"{'/'.join(map(str, e.absolute_path)) or '<root>'}: {e.message}"
        for e in validator.iter_errors(document)
    )


def test_compose_matches_the_compose_specification(compose: dict[str, Any]) -> None:
    assert schema_errors(compose) == []


def test_the_schema_catches_mistakes(compose: dict[str, Any]) -> None:
    broken = copy.deepcopy(compose)
    broken["services"]["scheduler"]["helthcheck"] = broken["services"]["scheduler"].pop("healthcheck")
    broken["services"]["worker"]["depends_on"]["nats"]["condition"] = "service_ready"
    errors = schema_errors(broken)
    assert any("helthcheck" in e for e in errors), errors
    assert any(e.startswith("services/worker/depends_on") for e in errors), errors


def test_secrets_are_required_and_the_example_sets_them() -> None:
    required = {m.group(1) for m in _VAR.finditer(COMPOSE_FILE.read_text()) if m.group(2) == ":?"}
    assert required == SECRETS
    example = env_example()
    assert example.keys() >= SECRETS
    for name in SECRETS:
        with pytest.raises(MissingVariable, match=name):
            interpolate(RAW, {k: v for k, v in example.items() if k != name})


@pytest.mark.parametrize("service", VIGIL_SERVICES)
def test_service_command_is_a_vigil_command(service: str) -> None:
    """Every service's command is a registered `vigil` command (no xfail: one unregistered by mistake fails)."""
    from vigil_cli.main import cli

    command = RAW["services"][service]["command"]
    assert command[0] in cli.commands, f"{service}: `vigil {command[0]}` is no command"
    assert_vigil_command(command)


def test_the_four_services_and_a_worker_per_profile_are_there(services: dict[str, dict[str, Any]]) -> None:
    commands = {name: services[name]["command"] for name in VIGIL_SERVICES}
    assert sorted(c[0] for c in commands.values()) == [
        "guardian",
        "scheduler",
        "telemetry",
        "worker",
        "worker",
    ]
    images = {name: (services[name]["image"], services[name]["build"]["target"]) for name in VIGIL_SERVICES}
    assert images == {
        "scheduler": ("vigil:dev", "control-plane"),
        "telemetry": ("vigil:dev", "control-plane"),
        "guardian": ("vigil:dev", "control-plane"),
        "worker": ("vigil-worker:dev", "worker"),
        "worker-gpu": ("vigil-worker:dev-gpu", "worker"),
    }
    assert all(services[name]["build"]["context"] == "." for name in VIGIL_SERVICES)


def dockerfile_stages() -> dict[str, str]:
    """Each `FROM ... AS name` stage of the Dockerfile, with the stages it builds on prepended."""
    stages: dict[str, str] = {}
    current = ""
    for line in (ROOT / "Dockerfile").read_text().splitlines():
        if m := re.match(r"FROM\s+(\S+)\s+AS\s+(\S+)", line, re.IGNORECASE):
            parent, current = m.groups()
            stages[current] = stages.get(parent, "")
        if current:
            stages[current] += line + "\n"
    return stages


def test_the_control_plane_image_installs_no_torch_and_the_worker_image_does() -> None:
    stages = dockerfile_stages()
    plane = [line for line in stages["control-plane"].splitlines() if not line.lstrip().startswith("#")]
    assert not [line for line in plane if re.search(r"torch|deepspeed|\[worker", line)], plane
    assert "pip install --no-build-isolation ./sdk ." in stages["control-plane"]
    worker = stages["worker"]
    assert re.search(r'"torch==', worker) and "deepspeed==" in worker and '".[worker]"' in worker


def test_every_vigil_variable_is_a_setting_with_a_valid_value(
    services: dict[str, dict[str, Any]], monkeypatch: pytest.MonkeyPatch
) -> None:
    dockerfile_vars = re.findall(r"\b(VIGIL_[A-Z_]+)=", (ROOT / "Dockerfile").read_text())
    for name, svc in services.items():
        env = svc.get("environment", {})
        assert isinstance(env, dict), f"{name}: use the mapping form of environment"
        variables = {k: str(v) for k, v in env.items() if k.startswith("VIGIL_")}
        unknown = unknown_settings([*variables, *dockerfile_vars])
        assert not unknown, f"{name}: not settings: {unknown}"
        if name in VIGIL_SERVICES:
            settings = settings_from(variables, monkeypatch)  # raises ConfigError naming the variable
            assert settings.nats_url and settings.database_url, name


def test_dependencies_exist_and_are_healthy_where_required(services: dict[str, dict[str, Any]]) -> None:
    for name, svc in services.items():
        for target, dep in svc.get("depends_on", {}).items():
            assert target in services, f"{name} depends on unknown {target}"
            assert dep["condition"] in ("service_healthy", "service_started"), (name, target)
            if dep["condition"] == "service_healthy":
                assert "healthcheck" in services[target], (
                    f"{name} waits for {target}, which has no health check"
                )
            if "profiles" not in svc:
                assert "profiles" not in services[target], f"{name} (always on) depends on profiled {target}"
    for name in VIGIL_SERVICES:
        deps = services[name]["depends_on"]
        assert deps["nats"]["condition"] == deps["postgres"]["condition"] == "service_healthy", name


def test_health_checks_are_real(services: dict[str, dict[str, Any]]) -> None:
    for name in (*INFRA_HEALTHCHECKED, *VIGIL_SERVICES):
        check = services[name].get("healthcheck")
        assert check and not check.get("disable") and check["test"][0] in ("CMD", "CMD-SHELL"), name
    for name in VIGIL_SERVICES:
        svc = services[name]
        _, program, mode, arg = svc["healthcheck"]["test"]
        assert program == "vigil-healthcheck"
        if mode == "http":
            url = urlsplit(arg)
            assert url.path == "/healthz" and url.hostname == "127.0.0.1"
            assert str(url.port) == svc["environment"]["VIGIL_HTTP_PORT"]
            assert any(p.endswith(f":{url.port}") for p in svc["ports"])
        else:
            assert (mode, arg) == ("bus", svc["command"][0]), name


def test_gpu_profile_gives_a_worker_nvidia_devices(services: dict[str, dict[str, Any]]) -> None:
    cpu, gpu = services["worker"], services["worker-gpu"]
    assert "profiles" not in cpu and "deploy" not in cpu
    assert gpu["profiles"] == ["gpu"] and gpu["command"] == cpu["command"] == ["worker"]
    (device,) = gpu["deploy"]["resources"]["reservations"]["devices"]
    assert device["driver"] == "nvidia" and "gpu" in device["capabilities"]
    assert "whl/cu" in gpu["build"]["args"]["TORCH_INDEX_URL"]
    names = {services[w]["environment"]["VIGIL_NODE_NAME"] for w in ("worker", "worker-gpu")}
    assert len(names) == 2
    for worker in ("worker", "worker-gpu"):
        assert services[worker]["environment"]["VIGIL_NODE_ADDRESS"] in services  # resolvable on the network


def test_nats_config_is_accepted_by_nats_server(services: dict[str, dict[str, Any]]) -> None:
    nats = services["nats"]
    config = DEPLOY / "nats" / "nats.conf"
    mounted = {v.split(":")[0]: v.split(":")[1] for v in nats["volumes"]}
    assert mounted["./deploy/nats/nats.conf"] == nats["command"][1]
    included = Path(nats["command"][1]).parent / "authorization.conf"  # `include` is relative to the file
    assert mounted["./deploy/nats/authorization.conf"] == str(included)
    text = config.read_text()
    assert re.search(r"^\s*sync_interval:\s*always\s*$", text, re.M)
    assert re.search(r'^include "authorization.conf"$', text, re.M)
    env = {**os.environ, **nats["environment"]}
    check = subprocess.run([nats_server(), "-c", str(config), "-t"], env=env, capture_output=True, timeout=30)
    assert check.returncode == 0, check.stderr.decode()
    del env["NATS_GUARDIAN_PASSWORD"]  # a password left out: the server refuses to start
    check = subprocess.run([nats_server(), "-c", str(config), "-t"], env=env, capture_output=True, timeout=30)
    assert check.returncode != 0 and b"NATS_GUARDIAN_PASSWORD" in check.stderr


def test_each_service_connects_as_its_own_nats_user(services: dict[str, dict[str, Any]]) -> None:
    """Users and permissions are credentials.py's; each service's URL has its own user and that user's
    password (env.example's are all different), ranks get none, no service admin's."""
    nodes = [services[n]["environment"]["VIGIL_NODE_NAME"] for n in VIGIL_SERVICES if "worker" in n]
    assert sorted(nodes) == sorted(AUTHORIZATION.COMPOSE_NODES), "render deploy/nats/authorization.py"
    variables = assert_users_are_credentials_roles(AUTHORIZATION.COMPOSE_FILE.read_text(), nodes)
    nats_env = services["nats"]["environment"]
    assert sorted(nats_env) == sorted(variables.values()) == sorted(NATS_PASSWORDS)
    assert len(set(nats_env.values())) == len(nats_env), "deploy/env.example: one password per user"
    password = {user: nats_env[variable] for user, variable in variables.items()}
    for name in VIGIL_SERVICES:
        env = services[name]["environment"]
        command = services[name]["command"][0]
        role = service_role(command, env.get("VIGIL_NODE_NAME"))
        assert_connects_as(env["VIGIL_NATS_URL"], role, password[role])
        assert "VIGIL_RANK_NATS_URL" not in env, name  # ranks hold no bus credential


def test_collector_forwards_traces_to_jaeger(services: dict[str, dict[str, Any]]) -> None:
    collector = yaml.safe_load((DEPLOY / "otel" / "collector.yaml").read_text())
    pipeline = collector["service"]["pipelines"]["traces"]
    for kind in ("receivers", "processors", "exporters"):
        assert set(pipeline[kind]) <= set(collector[kind]), kind
    (exporter,) = (collector["exporters"][name] for name in pipeline["exporters"])
    assert exporter["endpoint"] == "jaeger:4317" and "jaeger" in services
    assert services["jaeger"]["image"].startswith("jaegertracing/all-in-one:")
    assert any(p.endswith(":16686") for p in services["jaeger"]["ports"])
    assert services["otel-collector"]["image"].startswith("otel/opentelemetry-collector-contrib:")
    http_port = collector["receivers"]["otlp"]["protocols"]["http"]["endpoint"].rsplit(":", 1)[1]
    for name in VIGIL_SERVICES:
        assert (
            services[name]["environment"]["OTEL_EXPORTER_OTLP_ENDPOINT"]
            == f"http://otel-collector:{http_port}"
        )


def test_dockerfile_builds_non_root_images_from_files_in_the_context() -> None:
    text = (ROOT / "Dockerfile").read_text()
    # the base is an argument (a site that mirrors images names its own), python:3.11-slim by default
    assert re.search(r"^ARG PYTHON_IMAGE=python:3\.11-slim$", text, re.M)
    assert re.search(r"^FROM \$\{PYTHON_IMAGE\} AS base$", text, re.M)
    # no `# syntax=` line: the engine's own Dockerfile frontend builds it, no docker/dockerfile image is pulled
    assert not re.search(r"^#\s*syntax\s*=", text, re.M | re.I)
    for name in ("control-plane", "worker"):
        assert "COPY --from=source /opt/vigil /opt/vigil" in dockerfile_stages()[name], name
    worker = dockerfile_stages()["worker"]
    assert re.search(r"^ARG TORCH_VERSION=2\.13\.0$", worker, re.M)
    assert re.search(r"^ARG TORCH_INDEX_URL=https://download\.pytorch\.org/whl/cpu$", worker, re.M)
    order = [
        worker.index(step)
        for step in (
            "TORCH_VERSION}",
            '"deepspeed==',
            "vigil-requirements /tmp/manifests worker",
            "COPY --from=source",
            'pip install --no-build-isolation ./sdk ".[worker]"',
        )
    ]
    assert order == sorted(order), "torch, DeepSpeed, the dependencies, then the code: the SDK and Vigil"
    plane = dockerfile_stages()["control-plane"]
    assert plane.index("vigil-requirements /tmp/manifests >") < plane.index("COPY --from=source")
    for name, stage in dockerfile_stages().items():
        if name in ("source", "manifests", "wheels", "base"):  # the stages the images are built from
            continue
        users = re.findall(r"^USER (\S+)$", stage, re.M)
        assert users and users[-1] not in ("root", "0"), name
        assert re.findall(r"^ENTRYPOINT (.+)$", stage, re.M) == ['["vigil"]'], name
    allowed = [p[1:] for p in (ROOT / ".dockerignore").read_text().split() if p.startswith("!")]
    for line in re.findall(r"^COPY (.+)$", text, re.M):
        if "--from=" in line:  # from another stage of this file, not from the context
            continue
        for source in [w for w in line.split() if not w.startswith("--")][:-1]:
            assert (ROOT / source).exists(), source
            assert any(source == a or source.startswith(a + "/") for a in allowed), (
                f"{source} is dockerignored"
            )


def _healthcheck() -> ModuleType:
    spec = importlib.util.spec_from_file_location("vigil_healthcheck", DEPLOY / "healthcheck.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_bus_health_check_finds_the_vigil_process(tmp_path: Path) -> None:
    hc = _healthcheck()
    (tmp_path / "1").mkdir()
    (tmp_path / "1" / "cmdline").write_bytes(b"/usr/local/bin/python3.11\0/usr/local/bin/vigil\0worker\0")
    (tmp_path / "42").mkdir()
    (tmp_path / "42" / "cmdline").write_bytes(b"python3\0/usr/local/bin/vigil-healthcheck\0bus\0guardian\0")
    (tmp_path / "self").mkdir()
    assert hc.vigil_running("worker", tmp_path)
    assert not hc.vigil_running("guardian", tmp_path)
    assert hc.nats_port("nats://u:p@nats:4333") == 4333 and hc.nats_port("nats://nats") == 4222


def test_bus_health_check_sees_an_established_connection() -> None:
    hc = _healthcheck()
    with socket.create_server(("127.0.0.1", 0)) as server:
        port = server.getsockname()[1]
        assert not hc.connected_to_port(port)  # listening is not connected
        with socket.create_connection(("127.0.0.1", port)) as client:
            peer, _ = server.accept()
            with peer:
                assert hc.connected_to_port(port)
                assert client


def test_http_health_check_wants_a_2xx() -> None:
    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            self.send_response(200 if self.path == "/healthz" else 503)
            self.end_headers()

        def log_message(self, *args: object) -> None:
            pass

    hc = _healthcheck()
    with ThreadingHTTPServer(("127.0.0.1", 0), Handler) as server:
        thread = threading.Thread(target=server.serve_forever, daemon=True)
        thread.start()
        base = f"http://127.0.0.1:{server.server_address[1]}"
        try:
            assert hc.main(["http", f"{base}/healthz"]) == 0
            assert hc.main(["http", f"{base}/readyz"]) == 1
        finally:
            server.shutdown()
    assert hc.main(["bogus"]) == 2


def _mounts(service: dict[str, Any]) -> dict[str, str]:
    """A service's bind mounts, host path -> container path."""
    return {v.split(":")[0]: v.split(":")[1] for v in service.get("volumes", []) if v.startswith("./")}


def test_prometheus_scrapes_telemetrys_metrics_port(services: dict[str, dict[str, Any]]) -> None:
    prom, telemetry = services["prometheus"], services["telemetry"]
    assert prom["profiles"] == ["monitoring"] and services["grafana"]["profiles"] == ["monitoring"]
    config_file = DEPLOY / "prometheus" / "prometheus.yml"
    assert f"--config.file={_mounts(prom)['./deploy/prometheus/prometheus.yml']}" in prom["command"]
    config = yaml.safe_load(config_file.read_text())
    (scrape,) = config["scrape_configs"]
    (static,) = scrape["static_configs"]
    metrics_port = telemetry["environment"]["VIGIL_METRICS_PORT"]
    assert static["targets"] == [f"telemetry:{metrics_port}"] and scrape["metrics_path"] == "/metrics"
    assert telemetry["environment"]["VIGIL_HTTP_HOST"] == "0.0.0.0"  # reachable from the prometheus container
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.skip("promtool missing (Debian's prometheus package; scripts/install.sh installs it)")
    check = subprocess.run([promtool, "check", "config", str(config_file)], capture_output=True, timeout=30)
    assert check.returncode == 0, check.stdout.decode() + check.stderr.decode()


def test_grafana_is_provisioned_with_prometheus_and_vigils_dashboards(
    services: dict[str, dict[str, Any]],
) -> None:
    from vigil_telemetry.metrics import _HELP

    grafana = _mounts(services["grafana"])
    provisioning = DEPLOY / "grafana" / "provisioning"
    assert grafana["./deploy/grafana/provisioning"] == "/etc/grafana/provisioning"
    (source,) = yaml.safe_load((provisioning / "datasources" / "prometheus.yaml").read_text())["datasources"]
    url = urlsplit(source["url"])
    assert url.hostname == "prometheus" and any(
        p.endswith(f":{url.port}") for p in services["prometheus"]["ports"]
    )
    (provider,) = yaml.safe_load((provisioning / "dashboards" / "vigil.yaml").read_text())["providers"]
    assert grafana["./deploy/grafana/dashboards"] == provider["options"]["path"]
    dashboards = sorted((DEPLOY / "grafana" / "dashboards").glob("*.json"))
    assert dashboards
    for path in dashboards:
        dashboard = json.loads(path.read_text())
        panels = [p for p in dashboard["panels"] if p["type"] != "row"]
        exprs = [t["expr"] for p in panels for t in p["targets"]]
        exprs += [v["query"]["query"] for v in dashboard["templating"]["list"]]
        assert exprs
        queried = {m for e in exprs for m in re.findall(r"\bvigil_[a-z_]+\b", e)}
        assert queried and queried <= set(_HELP), f"{path.name}: not served: {sorted(queried - set(_HELP))}"
        assert set(_HELP) - queried <= {
            "vigil_step_grad_norm",
            "vigil_step_last",
            "vigil_steps_total",
            "vigil_incidents_total",
        }
        uids = {p["datasource"]["uid"] for p in panels} | {
            t["datasource"]["uid"] for p in panels for t in p["targets"]
        }
        assert uids == {source["uid"]}, path.name
        ids = [p["id"] for p in dashboard["panels"]]
        assert len(ids) == len(set(ids)), f"{path.name}: panel ids repeat"


@pytest.mark.parametrize("service", ["guardian", "telemetry"])
def test_a_service_that_shares_its_work_scales(services: dict[str, dict[str, Any]], service: str) -> None:
    """`docker compose up --scale guardian=2` (guardians divide the jobs' shares; telemetry replicas share
    queue groups): no fixed container name or host port, and no volume a replica would have to own alone
    (only the shared checkpoints)."""
    svc = services[service]
    assert "container_name" not in svc
    assert not [p for p in svc.get("ports", []) if ":" in str(p) or isinstance(p, dict)], svc.get("ports")
    own = [v for v in svc.get("volumes", []) if not str(v).startswith("checkpoints:")]
    assert own == [], own


def test_the_images_dependency_layers_list_every_third_party_requirement() -> None:
    """deploy/requirements.py (the Dockerfile's `vigil-requirements`): the dependencies of Vigil and its
    SDK, and of the extras named, without the two projects themselves (installed from the code later)."""
    spec = importlib.util.spec_from_file_location("vigil_requirements", DEPLOY / "requirements.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    plane, worker = module.requirements(ROOT, []), module.requirements(ROOT, ["worker"])
    names = {re.split(r"[<>=!~\[; ]", r, maxsplit=1)[0].lower() for r in worker}
    assert not names & {"vigil", "vigil-training"}, names
    assert {"litestar", "nats-py", "pathspec"} <= names  # the root project's and the SDK's
    assert "torch" not in "".join(plane) and {"torch", "deepspeed"} <= names
    assert set(plane) < set(worker) and len(worker) == len(set(worker))
