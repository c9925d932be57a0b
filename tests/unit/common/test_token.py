"""The API token: one rule for the gateway, `vigil up` and the CLI clients."""

from __future__ import annotations

import stat
from pathlib import Path

import pytest

from vigil.errors import ConfigError
from vigil_common.settings import Settings
from vigil_common.token import ensure_token, read_token, require_token

TOKEN = "unit-token-0123456789"


def test_token_from_env_else_file_else_generated(tmp_path: Path) -> None:
    assert ensure_token(Settings.load(api_token=TOKEN, data_dir=tmp_path)) == TOKEN
    assert read_token(Settings.load(data_dir=tmp_path)) is None
    generated = ensure_token(Settings.load(data_dir=tmp_path))
    path = tmp_path / "api_token"
    assert path.read_text().strip() == generated and len(generated) >= 32
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    # the scheduler, `vigil up` and the CLI agree
    assert ensure_token(Settings.load(data_dir=tmp_path)) == generated
    assert require_token(Settings.load(data_dir=tmp_path)) == generated


def test_a_short_token_is_refused_from_the_file_as_from_the_environment(tmp_path: Path) -> None:
    (tmp_path / "api_token").write_text("a\n")
    (tmp_path / "api_token").chmod(0o600)
    for use in (read_token, ensure_token, require_token):
        with pytest.raises(ConfigError, match=r"api_token is shorter than 16 characters"):
            use(Settings.load(data_dir=tmp_path))
    assert (tmp_path / "api_token").read_text() == "a\n"  # never overwritten behind the user's back
    with pytest.raises(ConfigError, match="VIGIL_API_TOKEN"):
        Settings.load(api_token="short", data_dir=tmp_path)


def test_a_client_without_a_token_is_told_where_to_get_one(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="set VIGIL_API_TOKEN, or start `vigil up`"):
        require_token(Settings.load(data_dir=tmp_path))


@pytest.mark.parametrize("mode", [0o644, 0o640, 0o604, 0o660, 0o622])
def test_a_token_file_open_to_others_is_refused(tmp_path: Path, mode: int) -> None:
    path = tmp_path / "api_token"
    path.write_text(TOKEN + "\n")
    path.chmod(mode)
    for use in (read_token, ensure_token, require_token):
        with pytest.raises(ConfigError, match=r"open to other users .*chmod 600"):
            use(Settings.load(data_dir=tmp_path))
    path.chmod(0o600)
    assert read_token(Settings.load(data_dir=tmp_path)) == TOKEN
