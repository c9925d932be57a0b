"""Where the gateway is and the bearer token a client sends, as a client finds them from the environment.

VIGIL_API_URL, else `http://VIGIL_HTTP_HOST:VIGIL_HTTP_PORT` (127.0.0.1:8000). VIGIL_API_TOKEN, else the
file `api_token` in the data dir (VIGIL_DATA_DIR, `.vigil`), which `vigil up` (or a scheduler run alone)
creates once, mode 0600. A token shorter than 16 characters is refused wherever it comes from, and so is a
token file that anyone but its owner may read or write.

The control plane's settings (`vigil_common.settings`) take their defaults and the token file's rule from
here, so the SDK finds a gateway without importing the control plane.
"""

from __future__ import annotations

import stat
from collections.abc import Mapping
from pathlib import Path

from vigil.errors import ConfigError

DEFAULT_HTTP_HOST = "127.0.0.1"
DEFAULT_HTTP_PORT = 8000
DEFAULT_DATA_DIR = Path(".vigil")
TOKEN_FILE = "api_token"
MIN_TOKEN_LENGTH = 16  # the gateway's bearer token, from VIGIL_API_TOKEN or the token file


def token_file(data_dir: Path) -> Path:
    return data_dir.resolve() / TOKEN_FILE


def read_token_file(path: Path) -> str | None:
    """The token in `path`, or None where there is no such file. Raises ConfigError for a file that holds
    a token too short to be one, or that group or others may read or write."""
    try:
        mode = stat.S_IMODE(path.stat().st_mode)
        token = path.read_text().strip()
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise ConfigError(f"cannot read the API token file {path}: {exc.strerror}") from exc
    if mode & 0o077:
        raise ConfigError(
            f"the API token file {path} is open to other users (mode {mode:04o}): "
            f"`chmod 600 {path}`, or delete it (a new token is made)"
        )
    if len(token) < MIN_TOKEN_LENGTH:
        raise ConfigError(
            f"the API token in {path} is shorter than {MIN_TOKEN_LENGTH} characters: "
            "delete the file (a new token is made) or set VIGIL_API_TOKEN"
        )
    return token


def gateway_url(env: Mapping[str, str]) -> str:
    """VIGIL_API_URL, else the one VIGIL_HTTP_HOST and VIGIL_HTTP_PORT make. Raises ConfigError naming a
    port that is not one."""
    if url := env.get("VIGIL_API_URL"):
        return url
    host = env.get("VIGIL_HTTP_HOST") or DEFAULT_HTTP_HOST
    port = env.get("VIGIL_HTTP_PORT") or str(DEFAULT_HTTP_PORT)
    if not port.isdigit() or not 0 <= int(port) <= 65535:
        raise ConfigError(f"VIGIL_HTTP_PORT: {port!r} is not a port (0-65535)")
    return f"http://{host}:{int(port)}"


def client_token(env: Mapping[str, str]) -> str:
    """VIGIL_API_TOKEN, else the token file in VIGIL_DATA_DIR; ConfigError saying where to get one when
    there is none, or naming the variable or file that holds a bad one."""
    if token := env.get("VIGIL_API_TOKEN"):
        if len(token) < MIN_TOKEN_LENGTH:
            raise ConfigError(f"VIGIL_API_TOKEN: shorter than {MIN_TOKEN_LENGTH} characters")
        return token
    path = token_file(Path(env.get("VIGIL_DATA_DIR") or DEFAULT_DATA_DIR))
    if token := read_token_file(path):
        return token
    raise ConfigError(f"no API token: set VIGIL_API_TOKEN, or start `vigil up` here (it writes {path})")
