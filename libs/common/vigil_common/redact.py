"""Secrets out of everything Vigil prints: the one helper for URLs that may carry credentials.

NATS and Postgres URLs may hold a user's password (`nats://user:pw@host`, `postgresql://u:pw@h/db`,
`...?password=pw`). Whatever Vigil prints, logs or writes where others may read it (the `vigil up`
banner, error messages, a rank's command line) goes through `redact_url` or, for free text that may
quote a URL (a driver's own error message), `redact_text`.
"""

from __future__ import annotations

import re

MASK = "***"
# user:password@ in a URL's authority; the user stays visible, the password does not
_USERINFO = re.compile(r"(?P<scheme>[A-Za-z][A-Za-z0-9+.-]*://)(?P<user>[^:/@\s]*):(?P<secret>[^@/\s]*)@")
# password-like query parameters (libpq takes `password`, `sslpassword`; some tools `token`)
_QUERY = re.compile(r"(?P<key>[?&](?:ssl)?(?:password|passwd|pass|token|secret)=)(?P<secret>[^&#\s]*)", re.I)
# a bare token as userinfo (nats://TOKEN@host)
_TOKEN = re.compile(r"(?P<scheme>(?:nats|tls|ws|wss)://)(?P<secret>[^:/@\s]+)@")


def redact_url(url: str | None) -> str:
    """`url` with any password, token or password-like query parameter replaced by `***`."""
    if not url:
        return ""
    return redact_text(url)


def redact_text(text: str) -> str:
    """`text` with the credentials of every URL in it replaced by `***`."""
    text = _USERINFO.sub(lambda m: f"{m['scheme']}{m['user']}:{MASK}@", text)
    text = _TOKEN.sub(lambda m: f"{m['scheme']}{MASK}@", text)
    return _QUERY.sub(lambda m: f"{m['key']}{MASK}", text)


def has_secret(url: str | None) -> bool:
    """Whether `url` carries a credential that `redact_url` would hide."""
    return bool(url) and redact_url(url) != url
