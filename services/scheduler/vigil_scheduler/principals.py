"""Who calls the API, pure: the principal a token stands for, what it may see, how tokens are made and
hashed, and the file of users (VIGIL_USERS_FILE).

The gateway's own token (VIGIL_API_TOKEN, or the token file `vigil up` writes) is the admin's. Every
other token belongs to one user, has 256 random bits and is kept only as its SHA-256 (`users`): a
stolen copy of the database or of the users file holds no token. A user sees, follows and cancels
the jobs it owns and those of its team; an admin sees all.
"""

from __future__ import annotations

import hashlib
import re
import secrets
from dataclasses import dataclass
from pathlib import Path

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from vigil.errors import ConfigError

ADMIN = "admin"  # the gateway token's principal; no user may take the name
NAME_PATTERN = r"^[a-z0-9][a-z0-9._-]{0,62}$"
_NAME = re.compile(NAME_PATTERN)
_SHA256 = re.compile(r"^[0-9a-f]{64}$")
TOKEN_PREFIX = "vgu_"  # a user's token, told apart from the admin's at a glance


@dataclass(frozen=True, slots=True)
class Principal:
    """An authenticated caller: `actor` is what the audit record names (never a name the client chose)."""

    name: str
    actor: str
    team: str | None = None
    admin: bool = False

    def sees(self, owner: str, team: str | None) -> bool:
        """Whether a job of `owner` (in `team`) is this caller's to read, follow and cancel."""
        return self.admin or owner == self.name or (self.team is not None and team == self.team)


def user_principal(name: str, team: str | None, admin: bool) -> Principal:
    return Principal(name=name, actor=f"user:{name}", team=team, admin=admin)


def admin_principal(token: str) -> Principal:
    """The holder of the gateway's token: an admin named `admin`, audited as the token's fingerprint."""
    return Principal(name=ADMIN, actor="token:" + token_sha256(token)[:12], admin=True)


# The scheduler itself (a cancel it asks for on its own behalf): an admin, never a client.
SCHEDULER = Principal(name="scheduler", actor="service:scheduler", admin=True)


def new_token() -> str:
    """A user's token: 256 random bits, shown once when issued and never stored."""
    return TOKEN_PREFIX + secrets.token_urlsafe(32)


def token_sha256(token: str) -> str:
    return hashlib.sha256(token.strip().encode()).hexdigest()


def check_name(value: str, what: str = "user name") -> str:
    if not _NAME.match(value):
        raise ValueError(
            f"{what} {value[:80]!r} must be 1-63 lowercase letters, digits, '.', '_' or '-', "
            "starting with a letter or digit"
        )
    return value


# --- the file of users ------------------------------------------------------------------------------


class UserEntry(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str
    team: str | None = None
    admin: bool = False
    gpus: int | None = Field(None, ge=0, le=1_000_000, description="devices held at once; none: no limit")
    token_sha256: list[str] = Field(default_factory=list, description="SHA-256 (hex) of each token")

    @field_validator("name")
    @classmethod
    def _name(cls, value: str) -> str:
        check_name(value)
        if value == ADMIN:
            raise ValueError(f"{ADMIN!r} is the gateway token's principal; pick another name")
        return value

    @field_validator("team")
    @classmethod
    def _team(cls, value: str | None) -> str | None:
        return None if value is None else check_name(value, "team")

    @field_validator("token_sha256", mode="before")
    @classmethod
    def _hashes(cls, value: object) -> object:
        hashes = [value] if isinstance(value, str) else value
        if isinstance(hashes, list):
            for h in hashes:
                if not isinstance(h, str) or not _SHA256.match(h):
                    raise ValueError(
                        f"{str(h)[:80]!r} is no SHA-256: 64 lowercase hex digits "
                        "(`vigil users token-hash` makes a token and its hash)"
                    )
        return hashes


class TeamEntry(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str
    gpus: int | None = Field(None, ge=0, le=1_000_000)
    # its weight in the fair share; unset: left as it is (1, or what `vigil teams set-share` made it)
    share: float | None = Field(None, gt=0, le=1_000_000, allow_inf_nan=False)

    @field_validator("name")
    @classmethod
    def _name(cls, value: str) -> str:
        return check_name(value, "team")


class UsersFile(BaseModel):
    """VIGIL_USERS_FILE: `users: [{name, team, admin, gpus, token_sha256}]`, `teams: [{name, gpus,
    share}]`."""

    model_config = ConfigDict(extra="forbid")

    users: list[UserEntry] = Field(default_factory=list)
    teams: list[TeamEntry] = Field(default_factory=list)


def parse_users_file(text: str, where: str = "VIGIL_USERS_FILE") -> UsersFile:
    """The users file's contents (YAML or JSON); ConfigError naming the file and each bad field."""
    try:
        data = yaml.safe_load(text) or {}
    except yaml.YAMLError as exc:
        raise ConfigError(f"{where} is not YAML or JSON: {exc}") from exc
    try:
        users = UsersFile.model_validate(data)
    except ValidationError as exc:
        problems = "; ".join(
            f"{'.'.join(str(p) for p in e['loc']) or '(file)'}: {e['msg'].removeprefix('Value error, ')}"
            for e in exc.errors(include_url=False)
        )
        raise ConfigError(f"{where}: {problems}") from exc
    names = [u.name for u in users.users]
    if dupes := sorted({n for n in names if names.count(n) > 1}):
        raise ConfigError(f"{where}: user(s) {', '.join(dupes)} listed more than once")
    hashes = [h for u in users.users for h in u.token_sha256]
    if len(hashes) != len(set(hashes)):
        raise ConfigError(f"{where}: one token_sha256 is given to more than one user")
    return users


def load_users_file(path: Path) -> UsersFile:
    try:
        text = path.read_text()
    except OSError as exc:
        raise ConfigError(f"cannot read VIGIL_USERS_FILE {path}: {exc.strerror}") from exc
    return parse_users_file(text, f"VIGIL_USERS_FILE {path}")
