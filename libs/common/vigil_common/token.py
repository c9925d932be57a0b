"""The gateway's bearer token: one rule for the gateway, `vigil up` and the CLI clients (the token file's
part of it is the SDK's, `vigil.access`, which `vigil.Client.from_env` reads without these settings).

VIGIL_API_TOKEN when set; otherwise the file `api_token` in the data dir, which `vigil up` (or a
scheduler run alone) creates once with a random token, mode 0600, and the CLI on the same machine
reads. A token shorter than 16 characters is refused wherever it comes from, and so is a token file
that anyone but its owner may read or write.
"""

from __future__ import annotations

import os
import secrets
from pathlib import Path

from vigil.access import read_token_file, token_file
from vigil.errors import ConfigError
from vigil_common.settings import Settings


def token_path(settings: Settings) -> Path:
    return token_file(settings.data_dir)


def read_token(settings: Settings) -> str | None:
    """VIGIL_API_TOKEN, else the token file's contents, else None. Raises ConfigError for a token file
    holding a token too short to be one, or open to group or others (`vigil.access.read_token_file`)."""
    if settings.api_token:
        return settings.api_token  # its length is checked by Settings
    return read_token_file(token_path(settings))


def ensure_token(settings: Settings) -> str:
    """The token `read_token` finds, else a new random one written to the token file (mode 0600)."""
    if token := read_token(settings):
        return token
    path = token_path(settings)
    path.parent.mkdir(parents=True, exist_ok=True)
    token = secrets.token_urlsafe(32)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:  # another process made it first: use theirs
        return ensure_token(settings)
    with os.fdopen(fd, "w") as f:
        f.write(token + "\n")
    return token


def require_token(settings: Settings) -> str:
    """The token a client sends; ConfigError saying where to get one when there is none."""
    if token := read_token(settings):
        return token
    raise ConfigError(
        f"no API token: set VIGIL_API_TOKEN, or start `vigil up` here (it writes {token_path(settings)})"
    )
