"""deploy/nats/authorization.py: the deployments' NATS users are credentials.py's roles, the checked-in
files are what it renders (a permission changed in credentials.py and not rendered fails here), and
their passwords are variables that nats-server reads from its environment."""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.unit.deploy_checks import assert_users_are_credentials_roles, nats_authorization, nats_server
from vigil_common import credentials, subjects

AUTHORIZATION = nats_authorization()


def test_the_checked_in_files_are_as_rendered() -> None:
    for path, text in AUTHORIZATION.rendered().items():
        assert path.read_text() == text, f"{path}: run python deploy/nats/authorization.py"
    assert AUTHORIZATION.main(["--check"]) == 0


def test_a_permission_changed_in_credentials_py_and_not_rendered_is_caught(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    original = credentials.permissions

    def telemetry_may_command(role: str) -> dict[str, Any]:
        granted: dict[str, Any] = original(role)
        if role == credentials.TELEMETRY:
            granted["publish"]["allow"].append(subjects.ALL_CMDS)
        return granted

    monkeypatch.setattr(credentials, "permissions", telemetry_may_command)
    assert AUTHORIZATION.main(["--check"]) == 1
    stale = capsys.readouterr().err
    assert str(AUTHORIZATION.COMPOSE_FILE) in stale and str(AUTHORIZATION.K8S_FILE) in stale
    with pytest.raises(AssertionError):  # what test_compose.py and test_k8s.py check of each file
        assert_users_are_credentials_roles(
            AUTHORIZATION.COMPOSE_FILE.read_text(), ["worker-cpu", "worker-gpu"]
        )


def test_passwords_are_variables_nats_server_reads_from_its_environment(tmp_path: Path) -> None:
    conf = credentials.authorization_template(
        {"guardian": "NATS_GUARDIAN_PASSWORD", "admin": "NATS_ADMIN_PASSWORD"}
    )
    assert '"password": $NATS_GUARDIAN_PASSWORD,' in conf and '"$NATS' not in conf  # quoted: a literal
    assert AUTHORIZATION.users(conf)["guardian"] == {
        "password": "$NATS_GUARDIAN_PASSWORD",
        "permissions": credentials.permissions(credentials.GUARDIAN),
    }
    path = tmp_path / "nats.conf"
    path.write_text(conf)
    env = {"NATS_GUARDIAN_PASSWORD": "r", "NATS_ADMIN_PASSWORD": "a"}
    assert (
        subprocess.run([nats_server(), "-c", str(path), "-t"], env=env, capture_output=True).returncode == 0
    )
    missing = subprocess.run(
        [nats_server(), "-c", str(path), "-t"], env={"NATS_GUARDIAN_PASSWORD": "r"}, capture_output=True
    )
    assert missing.returncode != 0 and b"NATS_ADMIN_PASSWORD" in missing.stderr
    with pytest.raises(ValueError, match="variable name"):
        credentials.authorization_template({"guardian": "guardian-password"})


def test_kubernetes_workers_are_the_listed_nodes_with_one_password() -> None:
    manifest = AUTHORIZATION.k8s_authorization(["gpu-a", "gpu-b"])
    config_map = yaml.safe_load(manifest)
    assert (config_map["kind"], config_map["metadata"]["name"]) == ("ConfigMap", "nats-authorization")
    conf = config_map["data"]["authorization.conf"]
    assert conf == AUTHORIZATION.k8s_conf(manifest)
    assert AUTHORIZATION.k8s_nodes(manifest) == ["gpu-a", "gpu-b"]
    variables = assert_users_are_credentials_roles(conf, ["gpu-a", "gpu-b"])
    assert variables["worker-gpu-a"] == variables["worker-gpu-b"] == "NATS_WORKER_PASSWORD"
    others = [v for u, v in variables.items() if not u.startswith("worker-")]
    assert len(set(others)) == len(others) and "NATS_WORKER_PASSWORD" not in others
    with pytest.raises(SystemExit):  # a name that is no subject token is refused, nothing written
        AUTHORIZATION.main(["--k8s-nodes", "gpu-a,node.example.com", "--check"])
