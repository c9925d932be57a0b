"""The console's login pieces without a network: sessions expire and are revoked, failed logins wait
longer and longer, forms are read strictly, only local paths follow a login, and the guard refuses a
write from another origin or without the session's CSRF token."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import pytest
from litestar import Litestar, Request, Router, get, post
from litestar.datastructures import State
from litestar.testing import TestClient

from vigil_common.settings import Settings
from vigil_scheduler.console import security_headers
from vigil_scheduler.console.auth import (
    COOKIE,
    ConsoleAuth,
    LoginRefused,
    TooManyLogins,
    parse_form,
    read_form,
    safe_next,
)
from vigil_scheduler.console.sessions import FREE_FAILURES, MAX_WAIT_S, LoginThrottle, Sessions
from vigil_scheduler.gateway.errors import EXCEPTION_HANDLERS, BadForm
from vigil_scheduler.principals import admin_principal
from vigil_scheduler.users import Authenticator

TOKEN = "unit-token-0123456789"


def test_a_session_expires_and_a_revoked_one_is_gone() -> None:
    sessions = Sessions(lifetime_s=3600)
    cookie, session = sessions.open(now=1000.0)
    assert sessions.get(cookie, 1000.0 + 3599) == session
    assert sessions.get(cookie, 1000.0 + 3600) is None  # expired, and forgotten
    assert sessions.get(cookie, 1000.0) is None
    cookie, _ = sessions.open(now=0.0)
    sessions.revoke(cookie)
    assert sessions.get(cookie, 1.0) is None
    assert sessions.get("", 1.0) is None and sessions.get("made-up", 1.0) is None


def test_each_session_has_its_own_random_cookie_and_csrf_token() -> None:
    sessions = Sessions(lifetime_s=60)
    (a, sa), (b, sb) = sessions.open(0.0), sessions.open(0.0)
    assert a != b and sa.csrf != sb.csrf and len(a) >= 43 and len(sa.csrf) >= 43
    assert a not in repr(sessions.__dict__)  # only its hash is kept


def test_sessions_are_bounded_the_oldest_closed_first() -> None:
    sessions = Sessions(lifetime_s=60, limit=3)
    cookies = [sessions.open(float(i))[0] for i in range(4)]
    assert sessions.get(cookies[0], 5.0) is None
    assert all(sessions.get(c, 5.0) for c in cookies[1:])


def test_failed_logins_wait_exponentially_then_are_forgotten() -> None:
    throttle = LoginThrottle()
    for i in range(FREE_FAILURES):
        assert throttle.wait_s("10.0.0.1", float(i)) == 0.0
        throttle.failed("10.0.0.1", float(i))
    last = float(FREE_FAILURES - 1)
    assert throttle.wait_s("10.0.0.1", last) == 1.0
    assert throttle.wait_s("10.0.0.2", last) == 0.0  # per address
    waits = []
    now = last
    for _ in range(12):
        now += throttle.wait_s("10.0.0.1", now)
        throttle.failed("10.0.0.1", now)
        waits.append(throttle.wait_s("10.0.0.1", now))
    assert waits[:4] == [2.0, 4.0, 8.0, 16.0] and max(waits) == MAX_WAIT_S
    assert throttle.wait_s("10.0.0.1", now + MAX_WAIT_S) == 0.0
    throttle.failed("10.0.0.1", now + 10_000)  # long after: counted from zero again
    assert throttle.wait_s("10.0.0.1", now + 10_000) == 0.0
    throttle.succeeded("10.0.0.1")
    assert throttle.wait_s("10.0.0.1", now) == 0.0


async def test_login_refuses_past_the_throttle_whichever_token() -> None:
    clock = [0.0]
    auth = ConsoleAuth(Settings.load(api_token=TOKEN), clock=lambda: clock[0])
    tokens = Authenticator(TOKEN)
    for _ in range(FREE_FAILURES):
        with pytest.raises(LoginRefused) as refused:
            await auth.login("127.0.0.1", "wrong", tokens)
        assert refused.value.status_code == 401
    with pytest.raises(TooManyLogins) as throttled:
        await auth.login("127.0.0.1", TOKEN, tokens)
    assert throttled.value.status_code == 429 and throttled.value.headers == {"Retry-After": "1"}
    clock[0] += 1.0
    cookie = await auth.login("127.0.0.1", TOKEN, tokens)
    session = auth.sessions.get(cookie, clock[0])
    assert session is not None and session.principal is not None and session.principal.admin


def test_forms_are_read_strictly() -> None:
    assert parse_form(b"spec=name%3A+t%0A&csrf=x") == {"spec": "name: t\n", "csrf": "x"}
    assert parse_form(b"") == {}
    for body, field in (
        (b"spec=a&spec=b", "spec"),
        (b"spec=%ff", "(form)"),
        (b"\xff=1", "(form)"),
        (b"&".join(b"k%d=1" % i for i in range(100)), "(form)"),
    ):
        with pytest.raises(BadForm) as info:
            parse_form(body)
        assert info.value.field == field, body


@pytest.mark.parametrize(
    ("given", "kept"),
    [
        ("/jobs/j-1", True),
        ("/", True),
        ("//evil.example", False),
        ("/\\evil.example", False),
        ("/\t/evil.example", False),
        ("/a\nb", False),
        ("https://evil.example", False),
        ("/" + "a" * 3000, False),
    ],
)
def test_only_a_local_path_follows_a_login(given: str, kept: bool) -> None:
    assert safe_next(given) == (given if kept else "/")


@get("/page")
async def page() -> str:
    return "ok"


@post("/write")
async def write(request: Request) -> dict[str, str]:
    return await read_form(request)


@pytest.fixture
def client() -> Iterator[tuple[TestClient, ConsoleAuth]]:
    auth = ConsoleAuth(Settings.load(api_token=TOKEN))

    async def guard(connection, handler) -> None:  # type: ignore[no-untyped-def]
        await auth.guard(connection, handler)

    router = Router("/", route_handlers=[page, write], guards=[guard], middleware=[security_headers])
    app = Litestar(
        [router],
        exception_handlers=EXCEPTION_HANDLERS,  # type: ignore[arg-type]
        state=State({"authenticator": Authenticator(TOKEN), "parsing": asyncio.Semaphore(2)}),
        logging_config=None,
    )
    with TestClient(app) as c:
        yield c, auth


def test_the_guard_wants_a_session_or_the_bearer_token(client) -> None:
    c, auth = client
    assert c.get("/page").status_code == 401
    assert c.get("/page", headers={"Authorization": f"Bearer {TOKEN}"}).status_code == 200
    cookie, _ = auth.sessions.open(auth.clock())  # a session of nobody (no principal) opens nothing
    c.cookies[COOKIE] = cookie
    assert c.get("/page").status_code == 401
    cookie, _ = auth.sessions.open(auth.clock(), admin_principal(TOKEN))
    c.cookies[COOKIE] = cookie
    assert c.get("/page").status_code == 200
    auth.sessions.revoke(cookie)
    assert c.get("/page").status_code == 401


def test_a_write_needs_the_csrf_token_and_the_consoles_origin(client) -> None:
    c, auth = client
    cookie, session = auth.sessions.open(auth.clock(), admin_principal(TOKEN))
    c.cookies[COOKIE] = cookie
    r = c.post("/write", data={"x": "1"})
    assert r.status_code == 403 and "CSRF" in r.json()["message"]
    r = c.post("/write", data={"x": "1", "csrf": session.csrf})
    assert r.status_code == 201 and r.json() == {"x": "1", "csrf": session.csrf}
    own = str(c.base_url).rstrip("/")
    assert c.post("/write", data={"csrf": session.csrf}, headers={"Origin": own}).status_code == 201
    for headers in ({"Origin": "http://localhost:1"}, {"Sec-Fetch-Site": "same-site"}):
        r = c.post("/write", data={"csrf": session.csrf}, headers=headers)
        assert r.status_code == 403 and "refused" in r.json()["message"], headers
    bearer = {"Authorization": f"Bearer {TOKEN}"}
    assert c.post("/write", data={}, headers=bearer).status_code == 201
    r = c.post("/write", data={}, headers=bearer | {"Origin": "http://localhost:1"})
    assert r.status_code == 403


def test_every_answer_has_the_security_headers(client) -> None:
    c, _ = client
    for r in (c.get("/page"), c.post("/write", data={})):  # 401s: errors too
        assert "default-src 'self'" in r.headers["content-security-policy"]
        assert r.headers["x-frame-options"] == "DENY" and r.headers["x-content-type-options"] == "nosniff"
