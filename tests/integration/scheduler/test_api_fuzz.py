"""A bounded property-based run of the whole HTTP API: schemathesis draws requests from the gateway's own
OpenAPI schema (valid ones, and ones that break it on purpose) against a real `vigil scheduler` on real
NATS and Postgres, and every answer must be documented and none a 5xx. The web console's routes (left out
of that schema: they answer HTML) are fuzzed the same way from a schema written here, which a test keeps
in step with the console's routes; none of their answers may be a 5xx."""

from __future__ import annotations

import time
from typing import Any

import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis.errors import Unsatisfiable
from schemathesis import GenerationMode

from vigil_common.settings import Settings
from vigil_scheduler import console

from .conftest import GATEWAY_TOKEN as TOKEN

pytestmark = pytest.mark.integration

# Per operation and generation mode: a bound on the cases, not on the time, so that a loaded machine runs
# the same cases, only slower. Each parameter's boundaries are walked deterministically by
# test_api_coverage.py (schemathesis's coverage phase); this run draws at random beyond them.
EXAMPLES = 25
STREAMS = {"/api/v1/events", "/console/events"}  # server-sent events never end: not fuzzed here


def _string(**kw: Any) -> dict[str, Any]:
    return {"type": "string", **kw}


def _param(name: str, where: str, schema: dict[str, Any], required: bool = False) -> dict[str, Any]:
    return {"name": name, "in": where, "required": where == "path" or required, "schema": schema}


def _form(**fields: dict[str, Any]) -> dict[str, Any]:
    schema = {"type": "object", "properties": fields}
    return {"required": True, "content": {"application/x-www-form-urlencoded": {"schema": schema}}}


ANY = {"default": {"description": "any answer but a 5xx"}}
JOB = _param("job_id", "path", _string())
NODE, INDEX = _param("node", "path", _string()), _param("index", "path", {"type": "integer"})
# The console's routes as a fuzzer sees them: every parameter a plain string or integer, so that both
# modes reach the handlers with hostile values (NUL bytes, huge integers, ...).
CONSOLE_SCHEMA: dict[str, Any] = {
    "openapi": "3.0.3",
    "info": {"title": "Vigil console", "version": "1"},
    "paths": {
        "/login": {
            "get": {"parameters": [_param("next", "query", _string())], "responses": ANY},
            "post": {"requestBody": _form(token=_string(), next=_string()), "responses": ANY},
        },
        "/logout": {"post": {"requestBody": _form(csrf=_string()), "responses": ANY}},
        "/console/states.css": {"get": {"responses": ANY}},
        "/": {"get": {"parameters": [_param("state", "query", _string())], "responses": ANY}},
        "/jobs": {"post": {"requestBody": _form(spec=_string(), csrf=_string()), "responses": ANY}},
        "/jobs/{job_id}": {"get": {"parameters": [JOB], "responses": ANY}},
        "/jobs/{job_id}/cancel": {
            "post": {"parameters": [JOB], "requestBody": _form(csrf=_string()), "responses": ANY}
        },
        "/jobs/{job_id}/trace": {
            "get": {
                "parameters": [
                    JOB,
                    _param("step", "query", {"type": "integer"}),
                    _param("attempt", "query", {"type": "integer"}),
                ],
                "responses": ANY,
            }
        },
        "/cluster": {"get": {"parameters": [_param("color", "query", _string())], "responses": ANY}},
        "/cluster/{node}/{index}": {"get": {"parameters": [NODE, INDEX], "responses": ANY}},
        "/incidents": {"get": {"responses": ANY}},
        "/alerts": {"get": {"responses": ANY}},
        "/queue": {"get": {"responses": ANY}},
        "/console/data/jobs/{job_id}": {
            "get": {"parameters": [JOB, _param("points", "query", {"type": "integer"})], "responses": ANY}
        },
        "/console/data/gpus/{node}/{index}": {"get": {"parameters": [NODE, INDEX], "responses": ANY}},
        "/console/events": {"get": {"parameters": [_param("job", "query", _string())], "responses": ANY}},
    },
}


def _fuzz(schema: Any, base: str, documented_only: bool) -> tuple[int, set[int], list[str], set[str]]:
    """Every operation of `schema` but the streams, in both generation modes, with the bearer token;
    returns the cases run, the statuses seen, the problems (5xx, or undocumented with `documented_only`)
    and the operations run."""
    cases, seen = 0, set()
    problems: list[str] = []
    ran: set[str] = set()
    for result in schema.get_all_operations():
        op = result.ok()
        if op.path in STREAMS:
            continue
        documented = frozenset(op.definition.raw["responses"])
        ran.add(f"{op.method.upper()} {op.path}")
        for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):

            @given(case=op.as_strategy(generation_mode=mode))
            @settings(
                max_examples=EXAMPLES, deadline=None, database=None, suppress_health_check=list(HealthCheck)
            )
            def check(case: schemathesis.Case) -> None:
                nonlocal cases
                cases += 1
                case.headers = {**(case.headers or {}), "Authorization": f"Bearer {TOKEN}"}
                response = case.call(base_url=base, timeout=30, allow_redirects=False)
                seen.add(response.status_code)
                undocumented = documented_only and str(response.status_code) not in documented  # noqa: B023 - called below, in this iteration
                if response.status_code >= 500 or undocumented:
                    problems.append(
                        f"{case.method} {case.formatted_path} -> {response.status_code} "
                        f"(documented {sorted(documented)}): {response.text[:300]}"  # noqa: B023
                    )

            try:
                check()
            except Unsatisfiable:  # nothing to break: an operation without parameters or body
                assert mode is GenerationMode.NEGATIVE, op.path
    return cases, seen, problems, ran


def test_no_request_gets_a_5xx_or_an_undocumented_status(gateway: str) -> None:
    schema = schemathesis.openapi.from_url(f"{gateway}/schema/openapi.json")
    started = time.monotonic()
    cases, seen, problems, ran = _fuzz(schema, gateway, documented_only=True)
    took = time.monotonic() - started
    print(f"api fuzz: {cases} cases on {len(ran)} operations in {took:.1f}s, statuses {sorted(seen)}")
    assert not problems, "\n".join(problems[:20])
    assert len(ran) >= 30 and cases >= 20 * len(ran), (cases, sorted(ran))


def test_the_console_schema_covers_every_console_route() -> None:
    """So that a route added to the console is fuzzed too (static files aside)."""
    routers = console.console_routes(Settings.load(api_token=TOKEN))
    routes = {
        (
            method.lower(),
            route.path.replace("{job_id:str}", "{job_id}").replace(":str", "").replace(":int", ""),
        )
        for router in routers
        for route in router.routes
        if not route.path.startswith(console.STATIC_PATH)
        for method in route.methods
        if method not in ("HEAD", "OPTIONS")
    }
    written = {(m, p) for p, ops in CONSOLE_SCHEMA["paths"].items() for m in ops}
    assert routes == written, (routes - written, written - routes)


def test_no_console_request_gets_a_5xx(gateway: str) -> None:
    """Pages, their data and forms with hostile paths, queries and bodies (NUL bytes, integers past
    Postgres `int`, specs that are no YAML): each a 2xx, 3xx or 4xx."""
    started = time.monotonic()
    schema = schemathesis.openapi.from_dict(CONSOLE_SCHEMA)
    cases, seen, problems, ran = _fuzz(schema, gateway, documented_only=False)
    took = time.monotonic() - started
    print(f"console fuzz: {cases} cases on {len(ran)} routes in {took:.1f}s, statuses {sorted(seen)}")
    assert not problems, "\n".join(problems[:20])
    written = {
        f"{m.upper()} {p}" for p, ops in CONSOLE_SCHEMA["paths"].items() for m in ops if p not in STREAMS
    }
    assert ran == written and cases >= 20 * len(ran), (cases, sorted(written - ran))
