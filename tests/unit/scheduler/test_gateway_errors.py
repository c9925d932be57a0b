"""The gateway's error mapping and bearer auth, on a small in-memory app (no network)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from litestar import Litestar, get
from litestar.datastructures import State
from litestar.params import FromPath
from litestar.testing import TestClient

from vigil.errors import Conflict, NotFound, RetryableError, SpecError
from vigil_scheduler.gateway.auth import bearer_guard
from vigil_scheduler.gateway.errors import EXCEPTION_HANDLERS
from vigil_scheduler.users import Authenticator

TOKEN = "unit-token-0123456789"
RAISES = {
    "missing": NotFound("no job 'j-x'"),
    "finished": Conflict("job j-x is already SUCCEEDED"),
    "spec": SpecError([{"field": "train.lr", "message": "must be > 0"}]),
    "busy": RetryableError("database restarting"),
    "bug": RuntimeError("oops"),
}


@get("/fail/{what:str}", guards=[bearer_guard])
async def fail(what: FromPath[str]) -> None:
    raise RAISES[what]


@pytest.fixture
def client() -> Iterator[TestClient]:
    app = Litestar(
        [fail],
        exception_handlers=EXCEPTION_HANDLERS,
        state=State({"authenticator": Authenticator(TOKEN)}),
        logging_config=None,
    )  # type: ignore[arg-type]
    with TestClient(app) as c:
        c.headers["Authorization"] = f"Bearer {TOKEN}"
        yield c


@pytest.mark.parametrize(
    ("what", "status"), [("missing", 404), ("finished", 409), ("spec", 422), ("busy", 503), ("bug", 500)]
)
def test_each_error_class_has_one_status(client: TestClient, what: str, status: int) -> None:
    r = client.get(f"/fail/{what}")
    assert r.status_code == status
    body = r.json()
    assert body["status"] == status and set(body) == {"status", "error", "message", "fields"}
    if what == "spec":
        assert body["fields"] == [{"field": "train.lr", "message": "must be > 0"}]
    if what == "bug":
        assert "oops" not in body["message"]  # internals stay in the log


def test_bearer_token_is_required(client: TestClient) -> None:
    assert client.get("/fail/missing", headers={"Authorization": ""}).status_code == 401
    r = client.get("/fail/missing", headers={"Authorization": "Bearer nope"})
    assert r.status_code == 401 and r.headers["www-authenticate"] == "Bearer"
