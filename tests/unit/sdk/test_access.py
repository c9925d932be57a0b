"""`vigil.Client.from_env` finds the gateway and its token from the environment alone (`vigil.access`),
by the same rule as the control plane's settings, which take their defaults from it."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from vigil.access import client_token, gateway_url
from vigil.client import Client
from vigil.errors import ConfigError
from vigil_common.settings import Settings
from vigil_common.token import ensure_token, token_path

TOKEN = "t" * 24


def test_the_url_is_vigil_api_url_else_host_and_port_with_the_settings_defaults() -> None:
    assert gateway_url({"VIGIL_API_URL": "http://gw:1"}) == "http://gw:1"
    assert gateway_url({"VIGIL_HTTP_HOST": "10.0.0.2", "VIGIL_HTTP_PORT": "9000"}) == "http://10.0.0.2:9000"
    host, port = (Settings.model_fields[f].default for f in ("http_host", "http_port"))
    assert gateway_url({}) == f"http://{host}:{port}"
    with pytest.raises(ConfigError, match="VIGIL_HTTP_PORT: '80x'"):
        gateway_url({"VIGIL_HTTP_PORT": "80x"})


def test_the_token_is_vigil_api_token_else_the_file_vigil_up_writes(tmp_path: Path) -> None:
    env = {"VIGIL_DATA_DIR": str(tmp_path)}
    with pytest.raises(ConfigError, match="no API token: set VIGIL_API_TOKEN"):
        client_token(env)
    written = ensure_token(Settings.load(data_dir=tmp_path))  # what `vigil up` does
    assert client_token(env) == written
    assert client_token({**env, "VIGIL_API_TOKEN": TOKEN}) == TOKEN
    with pytest.raises(ConfigError, match="VIGIL_API_TOKEN: shorter than 16"):
        client_token({**env, "VIGIL_API_TOKEN": "short"})
    os.chmod(token_path(Settings.load(data_dir=tmp_path)), 0o644)
    with pytest.raises(ConfigError, match="open to other users"):
        client_token(env)


def test_from_env_builds_a_client_without_the_control_plane_settings(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("VIGIL_API_TOKEN", TOKEN)
    monkeypatch.setenv("VIGIL_HTTP_PORT", "8123")
    monkeypatch.setenv("VIGIL_NODE_NAME", "not a node name!")  # a control-plane setting: not read here
    with Client.from_env() as client:
        assert client.url == "http://127.0.0.1:8123"
        assert client._http.headers["Authorization"] == f"Bearer {TOKEN}"
