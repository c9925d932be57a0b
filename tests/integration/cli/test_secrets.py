"""Secrets stay out of what others can read: `vigil up` with a password in its NATS and Postgres URLs
prints neither, keeps them out of endpoints.json (0600, in a 0700 data dir), and a service that cannot
reach NATS says so without the password."""

from __future__ import annotations

import json
import os
import signal
import stat
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

import pytest

from vigil_common.embedded import EmbeddedNats, free_port

pytestmark = pytest.mark.integration

SECRET = "pw-s3cret-Xq9"
VIGIL = str(Path(sys.executable).parent / "vigil")


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("VIGIL_")}
    return env | {"VIGIL_METRICS_PORT": "0"} | extra


@pytest.fixture
def nats_with_password(tmp_path: Path) -> Iterator[str]:
    port = free_port()
    conf = tmp_path / "nats.conf"
    conf.write_text(
        f'port: {port}\nhost: 127.0.0.1\nauthorization {{ user: vigil, password: "{SECRET}" }}\n'
        f'jetstream {{ store_dir: "{tmp_path / "js"}" }}\n'
    )
    proc = subprocess.Popen(
        [EmbeddedNats.binary(), "-c", str(conf)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    try:
        yield f"nats://vigil:{SECRET}@127.0.0.1:{port}"
    finally:
        proc.terminate()
        proc.wait(10)


def test_vigil_up_prints_and_stores_no_password(
    nats_with_password: str, database_url: str, tmp_path: Path
) -> None:
    parts = urlsplit(database_url)
    host = parts.netloc.rsplit("@", 1)[-1]
    user = parts.username or "postgres"
    pg_url = urlunsplit(parts._replace(netloc=f"{user}:{SECRET}@{host}"))  # trust auth: any password works
    data = tmp_path / "data"
    env = _env(
        VIGIL_NATS_URL=nats_with_password,
        VIGIL_DATABASE_URL=pg_url,
        VIGIL_DATA_DIR=str(data),
        VIGIL_HTTP_PORT=str(free_port()),
    )
    up = subprocess.Popen(
        [VIGIL, "up"],
        env=env,
        cwd=tmp_path,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    banner: list[str] = []
    try:
        assert up.stdout is not None
        for line in up.stdout:  # the banner ends with this line; the process runs on
            banner.append(line)
            if "Ctrl-C to stop" in line or len(banner) > 200:
                break
        text = "".join(banner)
        assert "Ctrl-C to stop" in text, text
        assert SECRET not in text and "vigil:***@" in text, text
        endpoints = data / "endpoints.json"
        assert stat.S_IMODE(endpoints.stat().st_mode) == 0o600
        assert SECRET not in endpoints.read_text()
        assert json.loads(endpoints.read_text())["nats_url"] is None  # a service alone is given it by env
        assert stat.S_IMODE(data.stat().st_mode) == 0o700
        assert stat.S_IMODE((data / "api_token").stat().st_mode) == 0o600
    finally:
        up.send_signal(signal.SIGINT)
        up.communicate(timeout=60)


def test_cannot_reach_nats_names_the_server_not_the_password(tmp_path: Path) -> None:
    url = f"nats://vigil:{SECRET}@127.0.0.1:{free_port()}"
    result = subprocess.run(
        [VIGIL, "worker"],
        env=_env(VIGIL_NATS_URL=url, VIGIL_DATA_DIR=str(tmp_path), VIGIL_CONNECT_TIMEOUT_S="1"),
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert result.returncode != 0
    out = result.stdout + result.stderr
    assert "cannot reach NATS at nats://vigil:***@127.0.0.1" in out, out
    assert SECRET not in out, out
