"""Console logins, pure (the clock is passed in): the sessions a login opens and logout revokes, and the
throttle on failed logins.

A session lives in the scheduler's memory: its cookie is 256 random bits, of which only the SHA-256 is
kept, and it ends at its expiry, at logout (a replayed cookie is refused from then on) or when the
scheduler restarts (every browser logs in again). Each session has its own CSRF token, which every
form that changes something must send back.
"""

from __future__ import annotations

import hashlib
import secrets
from dataclasses import dataclass

from vigil_scheduler.principals import Principal

MAX_SESSIONS = 1024  # logins held at once; past it the oldest is closed
FREE_FAILURES = 5  # failed logins from one address before each next try must wait
MAX_WAIT_S = 300.0  # the longest wait: 2 ** (failures - FREE_FAILURES) s, at most this
FORGET_AFTER_S = 900.0  # an address with no failure for this long starts again from zero
MAX_ADDRESSES = 10_000


@dataclass(frozen=True)
class Session:
    csrf: str
    expires_at: float
    principal: Principal | None = None  # who logged in (the token's user); None: nobody, refused


def _key(cookie: str) -> str:
    return hashlib.sha256(cookie.encode()).hexdigest()


class Sessions:
    """The open console sessions, by the hash of their cookie."""

    def __init__(self, lifetime_s: float, limit: int = MAX_SESSIONS) -> None:
        self.lifetime_s = lifetime_s
        self.limit = limit
        self._open: dict[str, Session] = {}

    def open(self, now: float, principal: Principal | None = None) -> tuple[str, Session]:
        """A new session of `principal`: its cookie value (given to the browser, never stored) and the
        session."""
        if len(self._open) >= self.limit:
            self._open = {k: s for k, s in self._open.items() if s.expires_at > now}
            while len(self._open) >= self.limit:  # still full: close the oldest login
                del self._open[next(iter(self._open))]
        cookie = secrets.token_urlsafe(32)
        session = Session(
            csrf=secrets.token_urlsafe(32), expires_at=now + self.lifetime_s, principal=principal
        )
        self._open[_key(cookie)] = session
        return cookie, session

    def get(self, cookie: str, now: float) -> Session | None:
        """The session of `cookie`, or None when it was never opened, has expired or was revoked."""
        if not cookie:
            return None
        key = _key(cookie)
        session = self._open.get(key)
        if session is not None and session.expires_at <= now:
            del self._open[key]
            return None
        return session

    def revoke(self, cookie: str) -> None:
        self._open.pop(_key(cookie), None)


class LoginThrottle:
    """Failed logins per client address: the first FREE_FAILURES cost nothing; after that each try must
    wait 2 ** (failures - FREE_FAILURES) seconds (at most MAX_WAIT_S) after the last failure, right or
    wrong token alike. A success, or FORGET_AFTER_S without a failure, starts the address afresh."""

    def __init__(self) -> None:
        self._failures: dict[str, tuple[int, float]] = {}  # address -> (failures, last failure at)

    def wait_s(self, address: str, now: float) -> float:
        """Seconds before `address` may try again (0: now)."""
        count, last = self._failures.get(address, (0, 0.0))
        if count < FREE_FAILURES or now - last >= FORGET_AFTER_S:
            return 0.0
        return max(0.0, min(2.0 ** (count - FREE_FAILURES), MAX_WAIT_S) - (now - last))

    def failed(self, address: str, now: float) -> None:
        count, last = self._failures.pop(address, (0, 0.0))
        if now - last >= FORGET_AFTER_S:
            count = 0
        if len(self._failures) >= MAX_ADDRESSES:
            self._failures = {a: f for a, f in self._failures.items() if now - f[1] < FORGET_AFTER_S}
            while len(self._failures) >= MAX_ADDRESSES:
                del self._failures[next(iter(self._failures))]
        self._failures[address] = (count + 1, now)

    def succeeded(self, address: str) -> None:
        self._failures.pop(address, None)
