"""Where a running `vigil up` keeps its NATS and Postgres, for the services and the CLI started alone on the
same data dir: the endpoints file it writes (`write_endpoints`) and the URLs a service reads from it, with
its role's credential (`resolve_urls`)."""

from __future__ import annotations

import json
import os
from pathlib import Path

from vigil.errors import ConfigError
from vigil_common.credentials import ADMIN, APP_ROLE, CREDENTIALS_FILE, load_or_create, with_user
from vigil_common.redact import has_secret
from vigil_common.settings import Settings


def endpoints_file(settings: Settings) -> Path:
    return settings.data_dir.resolve() / "endpoints.json"


def write_endpoints(settings: Settings, nats_url: str, database_url: str) -> None:
    """Where this `vigil up`'s NATS and Postgres are, for services and the CLI started alone on the same
    data dir (mode 0600). Give URLs without passwords: `resolve_urls` adds each role's own from the
    credentials file. A URL that still carries a password is left out (null): a service started alone
    is then given it the way `vigil up` was, by its VIGIL_* variable, and no secret lies in the file."""
    path = endpoints_file(settings)
    tmp = path.with_suffix(".tmp")
    found = {
        "nats_url": None if has_secret(nats_url) else nats_url,
        "database_url": None if has_secret(database_url) else database_url,
        "pid": os.getpid(),
    }
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as out:
        os.fchmod(out.fileno(), 0o600)  # an older file of another mode is reused by O_CREAT
        out.write(json.dumps(found))
    tmp.replace(path)


def resolve_urls(settings: Settings, role: str = ADMIN) -> Settings:
    """Settings with the URLs that VIGIL_* leave unset filled in from a `vigil up` running on the same
    data dir (its endpoints file), with `role`'s NATS credential and the Postgres password from its
    credentials file; unchanged when there is none, or its `vigil up` has died. Each service then
    checks for what it needs (`vigil_common.service.require_urls`)."""
    if settings.nats_url and settings.database_url:
        return settings
    try:
        found = json.loads(endpoints_file(settings).read_text())
        pid, nats_url, database_url = int(found["pid"]), found["nats_url"], found["database_url"]
    except (OSError, ValueError, TypeError, KeyError):
        return settings
    if pid <= 0 or not process_alive(pid):
        return settings
    creds_file = settings.data_dir.resolve() / CREDENTIALS_FILE
    if creds_file.exists():
        creds = load_or_create(creds_file)
        if role not in creds.nats:
            raise ConfigError(
                f"no NATS credential for {role} in {creds_file}: start `vigil up` with this node's "
                "VIGIL_NODE_NAME, or set VIGIL_NATS_URL"
            )
        nats_url = creds.nats_url(nats_url, role)
        database_url = with_user(database_url, APP_ROLE, creds.postgres_app)
    return settings.model_copy(
        update={
            "nats_url": settings.nats_url or nats_url or None,
            "database_url": settings.database_url or database_url or None,
        }
    )


def process_alive(pid: int) -> bool:
    """Whether process `pid` runs (a zombie does not; one of another user does)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return not Path(f"/proc/{pid}/stat").exists() or Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
