"""One path for a service's NATS user: run alone (`vigil worker`) or by `vigil up` (`Infra.settings_for`)."""

from __future__ import annotations

from vigil_cli.services import SERVICES, nats_user
from vigil_cli.stack import Infra
from vigil_common import credentials
from vigil_common.settings import Settings


def test_each_service_connects_as_its_own_user_a_worker_as_its_nodes() -> None:
    assert nats_user("vigil_scheduler.main", "n1") == credentials.SCHEDULER
    assert nats_user("vigil_guardian.main", "n1") == credentials.GUARDIAN
    assert nats_user("vigil_telemetry.main", "n1") == credentials.TELEMETRY
    assert nats_user("vigil_worker.main", "n1") == credentials.worker_role("n1")


def test_vigil_up_gives_each_service_its_users_url_and_without_users_the_one_url() -> None:
    settings = Settings(node_name="n1", nats_url="nats://admin:pw@127.0.0.1:4222")
    users = [nats_user(service, "n1") for service in SERVICES]
    infra = Infra(settings=settings, role_urls={user: f"nats://{user}:pw@127.0.0.1:4222" for user in users})
    for service, user in zip(SERVICES, users, strict=True):
        assert infra.settings_for(service).nats_url == f"nats://{user}:pw@127.0.0.1:4222"
    assert Infra(settings=settings).settings_for("vigil_worker.main").nats_url == settings.nats_url
