"""Alert routes against the real gateway, telemetry, NATS and Postgres, and a real HTTP receiver: a `json`
route's deliveries are signed (the SDK's `verify` takes them, and refuses a tampered body), retried
after a receiver's 500s and logged; a route hears only the jobs its owner sees, and is seen and deleted
only by its owner, their team and admins; a bad route is a 422 naming the field."""

from __future__ import annotations

import asyncio
import json
import shlex
from pathlib import Path

import pytest
from click.testing import CliRunner, Result

from tests.doc_commands import GUIDES, bash_blocks
from tests.helpers import eventually, service
from tests.integration.alert_receiver import receiver
from vigil.alerts import SIGNATURE_HEADER, SignatureError, verify
from vigil.events import IncidentRaised
from vigil_cli.main import cli
from vigil_common import subjects
from vigil_common.settings import Settings
from vigil_telemetry.main import run as telemetry

from .conftest import Running, spec

pytestmark = pytest.mark.integration

ROUTES = "/api/v1/alerts/routes"


def telemetry_settings(scheduler: Running, nats_url: str, tmp_path: Path) -> Settings:
    return Settings.load(
        nats_url=nats_url,
        database_url=scheduler.settings.database_url,
        data_dir=tmp_path / "telemetry",
        metrics_port=0,
        alert_backoff_s=0.05,
        console_url="https://vigil.example",
    )


async def vigil(scheduler: Running, token: str, *args: str) -> Result:
    env = {"VIGIL_API_TOKEN": token, "VIGIL_HTTP_PORT": str(scheduler.settings.http_port), "COLUMNS": "200"}
    return await asyncio.to_thread(CliRunner().invoke, cli, list(args), env=env)  # the CLI is synchronous


async def submitted(client, name: str) -> str:
    r = await client.post("/api/v1/jobs", json=spec(name, per_node=64))  # never placed: stays PENDING
    assert r.status_code == 201, r.text
    return r.json()["id"]


async def test_a_signed_delivery_is_retried_across_a_restart_to_a_receiver_that_verifies_it(
    scheduler, as_user, bus, nats_url, tmp_path
):
    alice = await as_user("alice", "ml")
    bob = await as_user("bob", "ops")
    job = await submitted(alice, "alerted")
    async with receiver([500, 500]) as hook, receiver() as slack:
        r = await alice.post(ROUTES, json={"name": "mine", "url": hook.url, "filter": {"jobs": [job]}})
        assert r.status_code == 201, r.text
        route, secret = r.json()["id"], r.json()["secret"]
        assert secret.startswith("vgw_")
        assert "secret" not in (await alice.get(f"{ROUTES}/{route}")).json()
        r = await bob.post(ROUTES, json={"name": "everything", "url": hook.url})  # no filter, another team
        assert r.status_code == 201, r.text
        bobs = r.json()["id"]
        for name, least in (("team-chat", "error"), ("pager", "critical")):  # a rollback is an error
            r = await alice.post(
                ROUTES,
                json={"name": name, "url": slack.url, "format": "slack", "team": "ml",
                      "filter": {"teams": ["ml"], "min_severity": least}},
            )  # fmt: skip
            assert r.status_code == 201, r.text

        incident = IncidentRaised(job_id=job, attempt=1, kind="nan", action="rollback", step=7, message="NaN")

        async def log() -> list[dict]:
            return (await alice.get(f"{ROUTES}/{route}/deliveries")).json()["items"]

        async def failed_once():
            found = await log()
            return found if found and found[0]["attempts"] == 1 and found[0]["last_error"] else None

        slow = telemetry_settings(scheduler, nats_url, tmp_path).model_copy(update={"alert_backoff_s": 60.0})
        async with service(telemetry, slow):  # takes the incident, posts it once (500), stops
            await bus.publish(subjects.incident(job), incident)
            (pending,) = await eventually(failed_once, timeout=10, what="the first attempt logged")
        assert pending["status"] == "pending" and pending["last_error"] == "HTTP 500" and len(hook.got) == 1
        (message,) = await slack.wait_for(1)  # the error-level route's; the critical one's never comes
        blocks = json.loads(message.body)["blocks"]
        assert blocks[0]["text"]["text"] == f"ERROR: nan on {job} (rollback)"
        assert blocks[4]["elements"][0]["url"] == f"https://vigil.example/jobs/{job}"
        assert SIGNATURE_HEADER.lower() not in message.headers
        # the back-off has passed: the row is due for the telemetry started next, which has the incident
        # only from the outbox (the first one acknowledged it on the bus)
        await scheduler.pool.execute(
            "UPDATE alert_deliveries SET next_at = now() WHERE id = $1", pending["id"]
        )
        async with service(telemetry, telemetry_settings(scheduler, nats_url, tmp_path)):
            got = await hook.wait_for(3)  # 500, 500, then 200
            for g in got:
                assert g.method == "POST" and g.path == "/hook"
                verify(secret, g.headers[SIGNATURE_HEADER.lower()], g.body)
                assert IncidentRaised.model_validate_json(g.body) == incident
                assert g.headers["idempotency-key"] == f"{incident.event_id}-firing"
            with pytest.raises(SignatureError, match="does not match"):
                verify(secret, got[-1].headers[SIGNATURE_HEADER.lower()], got[-1].body.replace(b"NaN", b"ok"))

            async def logged():
                items = await log()
                return items if items and items[0]["status"] == "delivered" else None

            (delivery,) = await eventually(logged, timeout=10, what="the delivery logged as delivered")
        assert delivery["attempts"] == 3 and delivery["last_error"] == "HTTP 500"
        assert delivery["incident_id"] == incident.event_id and delivery["phase"] == "firing"
        assert delivery["delivered_at"] is not None and delivery["next_at"] is None
        # bob's route wanted everything, but hears only the jobs bob sees: alice's is not one
        assert (await bob.get(f"{ROUTES}/{bobs}/deliveries")).json()["items"] == []
        assert len(hook.got) == 3 and len(slack.got) == 1


async def test_who_sees_a_route_and_what_a_bad_route_is_told(scheduler, as_user):
    alice = await as_user("alice", "ml")
    carol = await as_user("carol", "ml")
    bob = await as_user("bob", "ops")
    url = "https://hooks.example/vigil"
    r = await alice.post(ROUTES, json={"name": "own", "url": url, "format": "slack"})
    assert r.status_code == 201 and r.json()["secret"] is None, r.text
    own = r.json()["id"]
    r = await alice.post(ROUTES, json={"name": "team's", "url": url, "format": "alertmanager", "team": "ml"})
    assert r.status_code == 201, r.text
    teams = r.json()["id"]

    def ids(r):
        assert r.status_code == 200, r.text
        return {i["id"] for i in r.json()["items"]}

    assert ids(await alice.get(ROUTES)) == {own, teams}
    assert ids(await carol.get(ROUTES)) == {teams}
    assert ids(await bob.get(ROUTES)) == set()
    assert {own, teams} <= ids(await scheduler.http.get(ROUTES))  # the admin's token sees every route
    for path in (f"{ROUTES}/{own}", f"{ROUTES}/{own}/deliveries", f"{ROUTES}/r-0000000000000000"):
        for client in (bob, carol):
            r = await client.get(path)
            assert r.status_code == 404 and r.json()["error"] == "NotFound", r.text
    assert (await bob.delete(f"{ROUTES}/{teams}")).status_code == 404
    r = await carol.delete(f"{ROUTES}/{teams}")  # a team's route is everyone's in the team
    assert r.status_code == 200 and r.json()["id"] == teams, r.text
    assert ids(await alice.get(ROUTES)) == {own}

    bad = {
        "format": {"name": "x", "url": url, "format": "xml"},
        "url": {"name": "x", "url": "ftp://files.example/"},
        "filter.kinds.0": {"name": "x", "url": url, "filter": {"kinds": ["meteor"]}},
        "filter.min_severity": {"name": "x", "url": url, "filter": {"min_severity": "dire"}},
        "team": {"name": "x", "url": url, "team": "ops"},  # not alice's team
    }
    for field, body in bad.items():
        r = await alice.post(ROUTES, json=body)
        assert r.status_code == 422, (field, r.text)
        assert [f["field"] for f in r.json()["fields"]] == [field], (field, r.text)
    r = await alice.get(f"{ROUTES}/not-a-route")
    assert r.status_code == 422 and r.json()["fields"][0]["field"] == "route_id", r.text


async def test_the_guides_commands_and_the_console_page(scheduler, as_user):
    """docs/guides/alerting.md's commands, run as printed (as a user of team ml), then the log and rm."""
    alice = await as_user("alice", "ml")
    bob = await as_user("bob", "ops")
    token = alice.headers["Authorization"].removeprefix("Bearer ")
    (printed,) = bash_blocks(GUIDES / "alerting.md")
    for command in printed:
        r = await vigil(scheduler, token, *shlex.split(command)[1:])
        assert r.exit_code == 0, (command, r.output)
    assert (
        "signing secret (shown once" in (await vigil(scheduler, token, *shlex.split(printed[0])[1:])).output
    )
    listed = json.loads((await vigil(scheduler, token, "alerts", "list", "--json")).output)["items"]
    assert sorted(r["name"] for r in listed) == ["ml-slack", "oncall", "oncall", "ops"]
    (slack,) = [r for r in listed if r["name"] == "ml-slack"]
    assert slack["team"] == "ml" and slack["format"] == "slack"
    (oncall, _) = [r for r in listed if r["name"] == "oncall"]
    assert oncall["filter"]["kinds"] == ["nan", "spike"] and oncall["filter"]["min_severity"] == "error"

    page = await alice.get("/alerts")  # the console's page
    assert page.status_code == 200 and slack["id"] in page.text and "Nothing delivered yet" in page.text
    assert slack["id"] not in (await bob.get("/alerts")).text

    r = await vigil(scheduler, token, "alerts", "deliveries", slack["id"])
    assert r.exit_code == 0 and "ATTEMPTS" in r.output, r.output
    r = await vigil(scheduler, token, "alerts", "rm", slack["id"])
    assert r.exit_code == 0 and f"route {slack['id']} (ml-slack) deleted" in r.output, r.output
    r = await vigil(scheduler, token, "alerts", "rm", slack["id"])
    assert r.exit_code == 1 and "HTTP 404" in r.output, r.output
