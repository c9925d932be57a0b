"""A second user's token cannot read, follow, list or cancel the first user's job (issue 31: the probe read
and cancelled the victim with the one API token every job could reach). Against the real gateway: the
victim's job answers the attacker exactly as a job that does not exist, stays PENDING, and its audit
record names only its owner; the console logged in with the attacker's token shows none of it."""

from __future__ import annotations

import re

import httpx
import pytest

from tests.integration.scheduler.conftest import as_user, db_url, scheduler, spec  # noqa: F401 (fixtures)
from tests.integration.scheduler.ownership import assert_hidden

pytestmark = [pytest.mark.integration, pytest.mark.security]


async def test_a_second_users_token_cannot_read_follow_or_cancel_the_first_users_job(
    scheduler,  # noqa: F811
    as_user,  # noqa: F811
) -> None:
    victim = await as_user("victim", "research")
    attacker = await as_user("attacker", "other")
    job = (await victim.post("/api/v1/jobs", json=spec(per_node=64))).json()["id"]

    await assert_hidden(attacker, job)
    r = await victim.get(f"/api/v1/jobs/{job}")
    assert r.status_code == 200 and r.json()["state"] == "PENDING" and r.json()["owner"] == "victim"
    records = (await victim.get("/api/v1/audit", params={"job_id": job})).json()["items"]
    assert [(a["action"], a["actor"]) for a in records] == [("submit", "user:victim")]

    # the console, logged in with the attacker's token: no sign of the job, and its page is a 404
    token = attacker.headers["authorization"].removeprefix("Bearer ")
    async with httpx.AsyncClient(base_url=scheduler.base_url, timeout=10) as browser:
        r = await browser.post("/login", data={"token": token, "next": "/"})
        assert r.status_code == 303, r.text
        jobs = await browser.get("/")
        assert jobs.status_code == 200 and "attacker" in jobs.text and job not in jobs.text
        assert (await browser.get(f"/jobs/{job}")).status_code == 404
        assert (await browser.get(f"/console/data/jobs/{job}")).status_code == 404
        assert (await browser.get("/console/events", params={"job": job})).status_code == 404
        csrf = re.search(r'name="csrf" value="([^"]+)"', jobs.text)
        assert csrf is not None
        r = await browser.post(f"/jobs/{job}/cancel", data={"csrf": csrf.group(1)})
        assert r.status_code == 404
    assert (await victim.get(f"/api/v1/jobs/{job}")).json()["state"] == "PENDING"
