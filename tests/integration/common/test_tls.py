"""NATS over TLS with a private CA (VIGIL_NATS_TLS_CA): a real nats-server serving a certificate that
a CA made here signed; the bus connects and publishes with that CA, and refuses without it."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from vigil.errors import RetryableError
from vigil.events import CancelJob
from vigil_common import subjects
from vigil_common.bus import Bus
from vigil_common.embedded import EmbeddedNats

pytestmark = pytest.mark.integration


def openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True)


@pytest.fixture
def certificates(tmp_path: Path) -> tuple[Path, Path, Path]:
    """(ca.pem, server.pem, server.key): a CA, and a server certificate for 127.0.0.1 it signed."""
    if shutil.which("openssl") is None:
        pytest.skip("openssl missing")
    d = tmp_path / "pki"
    d.mkdir()
    openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=vigil-test-ca",
            "-keyout", "ca.key", "-out", "ca.pem", cwd=d)  # fmt: skip
    openssl("req", "-newkey", "rsa:2048", "-nodes", "-subj", "/CN=127.0.0.1",
            "-keyout", "server.key", "-out", "server.csr", cwd=d)  # fmt: skip
    (d / "san.ext").write_text("subjectAltName=IP:127.0.0.1\n")
    openssl("x509", "-req", "-in", "server.csr", "-CA", "ca.pem", "-CAkey", "ca.key", "-CAcreateserial",
            "-days", "1", "-extfile", "san.ext", "-out", "server.pem", cwd=d)  # fmt: skip
    return d / "ca.pem", d / "server.pem", d / "server.key"


async def test_the_bus_speaks_tls_to_nats_with_a_private_ca(tmp_path: Path, certificates) -> None:
    ca, cert, key = certificates
    with EmbeddedNats(tmp_path / "nats", tls=(cert, key)) as server:
        assert server.url.startswith("tls://")
        with pytest.raises(RetryableError, match="cannot reach NATS"):  # the system's CAs do not know it
            await Bus.connect(server.url, "tls-test", connect_timeout_s=3)
        bus = await Bus.connect(server.url, "tls-test", tls_ca=ca)
        try:
            await bus.ensure_streams()
            ack = await bus.publish(subjects.cmd("j-tls"), CancelJob(job_id="j-tls"))
            assert ack.seq >= 1
        finally:
            await bus.close()
