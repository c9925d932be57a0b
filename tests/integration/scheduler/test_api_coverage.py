"""The gateway's OpenAPI says what it does: schemathesis's coverage phase (a deterministic walk of every
operation's parameters and bodies, each at its boundaries and just past them: missing, empty, too long,
of the wrong type, malformed JSON) with all its conformance checks, against a real `vigil scheduler` on
real NATS and Postgres. Every answer must be documented, in the shape documented, and none a 5xx.

Run as `schemathesis run` does for a user (its CLI, its own checks); the random fuzzing is
test_api_fuzz.py's."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from .conftest import GATEWAY_TOKEN as TOKEN

pytestmark = pytest.mark.integration

STREAM = r"^/api/v1/events$"  # server-sent events never end: not walked here
CONFIG = Path(__file__).with_name("schemathesis.toml")  # the operations validated beyond their schema


def test_every_operation_answers_as_documented_under_the_coverage_phase(gateway: str, tmp_path: Path) -> None:
    report = tmp_path / "report.json"
    argv = [
        str(Path(sys.executable).parent / "schemathesis"), "--config-file", str(CONFIG),
        "run", f"{gateway}/schema/openapi.json",
        "--phases", "coverage",
        "--checks", "all",
        "--exclude-path-regex", STREAM,
        "-H", f"Authorization: Bearer {TOKEN}",
        "--request-timeout", "30",
        "--workers", "1",
        "--report", "ndjson", "--report-ndjson-path", str(report),
        "--no-color",
    ]  # fmt: skip
    out = subprocess.run(argv, capture_output=True, text=True, timeout=600, cwd=tmp_path)  # its cache there
    print(out.stdout[-6000:])
    assert out.returncode == 0, out.stdout[-12000:] + out.stderr[-2000:]
    # every operation but the event stream was walked, and the coverage phase ran and passed
    selected, total = map(int, re.search(r"Selected: (\d+)/(\d+)", out.stdout).groups())
    tested = int(re.search(r"Tested: (\d+)", out.stdout).group(1))
    assert tested == selected == total - 1 and total >= 30, out.stdout[-3000:]
    assert re.search(r"✅\s+Coverage", out.stdout), out.stdout[-3000:]
    assert report.stat().st_size > 0, "schemathesis wrote no report"
