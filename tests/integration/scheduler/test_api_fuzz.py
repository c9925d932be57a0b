"""A bounded property-based run of the whole HTTP API: schemathesis draws requests from the gateway's own
OpenAPI schema (valid ones, and ones that break it on purpose) against a real `vigil scheduler` on real
NATS and Postgres, and every answer must be documented and none a 5xx."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis.errors import Unsatisfiable
from schemathesis import GenerationMode

from vigil_common.embedded import free_port

from .conftest import fresh_database

pytestmark = pytest.mark.integration

TOKEN = "fuzz-token-0123456789abcdef"
EXAMPLES = 40  # per operation and generation mode
BUDGET_S = 75.0  # the whole run; operations past it are reported, not run
STREAMS = {"/api/v1/events"}  # server-sent events never end: not fuzzed here (tests/.../test_gateway.py)


@pytest.fixture
def gateway(nats_url: str, database_url: str, tmp_path: Path) -> Iterator[str]:
    db = asyncio.run(fresh_database(database_url))
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("VIGIL_")} | {
        "VIGIL_NATS_URL": nats_url,
        "VIGIL_DATABASE_URL": db,
        "VIGIL_DATA_DIR": str(tmp_path),
        "VIGIL_HTTP_PORT": str(port),
        "VIGIL_API_TOKEN": TOKEN,
        "VIGIL_MAX_BODY_BYTES": str(64 * 1024),
    }
    proc = subprocess.Popen([str(Path(sys.executable).parent / "vigil"), "scheduler"], env=env, cwd=tmp_path)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            assert proc.poll() is None, "the scheduler exited"
            try:
                if httpx.get(f"{base}/readyz", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "the scheduler was not ready in 60 s"
            time.sleep(0.1)  # polling a readiness endpoint
        yield base
    finally:
        proc.terminate()
        proc.wait(30)


def test_no_request_gets_a_5xx_or_an_undocumented_status(gateway: str) -> None:
    schema = schemathesis.openapi.from_url(f"{gateway}/schema/openapi.json")
    started, cases, seen = time.monotonic(), 0, set()
    problems: list[str] = []
    left_out = []
    for result in schema.get_all_operations():
        op = result.ok()
        if op.path in STREAMS:
            continue
        documented = frozenset(op.definition.raw["responses"])
        for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):
            if time.monotonic() - started > BUDGET_S:
                left_out.append(f"{op.method.upper()} {op.path} {mode.value}")
                continue

            @given(case=op.as_strategy(generation_mode=mode))
            @settings(
                max_examples=EXAMPLES, deadline=None, database=None, suppress_health_check=list(HealthCheck)
            )
            def check(case: schemathesis.Case) -> None:
                nonlocal cases
                cases += 1
                case.headers = {**(case.headers or {}), "Authorization": f"Bearer {TOKEN}"}
                response = case.call(base_url=gateway, timeout=30)
                seen.add(response.status_code)
                if response.status_code >= 500 or str(response.status_code) not in documented:  # noqa: B023 - called below, in this iteration
                    problems.append(
                        f"{case.method} {case.formatted_path} -> {response.status_code} "
                        f"(documented {sorted(documented)}): {response.text[:300]}"  # noqa: B023
                    )

            try:
                check()
            except Unsatisfiable:  # nothing to break: an operation without parameters or body
                assert mode is GenerationMode.NEGATIVE, op.path
    took = time.monotonic() - started
    print(f"api fuzz: {cases} cases in {took:.1f}s, statuses {sorted(seen)}, left out {left_out}")
    assert not problems, "\n".join(problems[:20])
    assert cases >= 200 and not left_out, (cases, left_out)
