"""What a receiver of Vigil's alerts needs: an incident's severity, and the signature of a `json` route's
deliveries (checked with `verify`).

A `json` route's POST carries the incident's JSON as its body and a header signed the way Stripe and
GitHub sign their webhooks:

    Vigil-Signature: t=<unix seconds>,v1=<hex HMAC-SHA256(secret, "<t>.<body>")>

The secret is the route's, shown once when the route is made. The timestamp is signed with the body, so
a delivery replayed later than `tolerance_s` is refused even though its signature is right:

    from vigil.alerts import SIGNATURE_HEADER, verify
    verify(secret, request.headers[SIGNATURE_HEADER], await request.body())  # raises SignatureError
"""

from __future__ import annotations

import hashlib
import hmac
import time
from typing import Literal, get_args

from vigil.errors import PermanentError

SIGNATURE_HEADER = "Vigil-Signature"
SCHEME = "v1"
DEFAULT_TOLERANCE_S = 300.0

# --- severity --------------------------------------------------------------------------------------------
# Incidents carry no severity of their own: it follows from what was done about them, in this one place.
# info: the scheduler stopped a job on purpose (a preemption, a time limit); warning: seen, or the ranks
# recovered on their own (alert, replay, skip); error: training stopped to be repaired (halt, rollback,
# restart); critical: the job failed.
Severity = Literal["info", "warning", "error", "critical"]
SEVERITIES: tuple[Severity, ...] = get_args(Severity)
_ON_PURPOSE = frozenset({"preemption", "time_limit"})
_REPAIRS = frozenset({"halt", "rollback", "restart"})


def severity(kind: str, action: str) -> Severity:
    """The severity of an incident of `kind` that the guardian (or scheduler) answered with `action`."""
    if action == "fail":
        return "critical"
    if kind in _ON_PURPOSE:
        return "info"
    if action in _REPAIRS:
        return "error"
    return "warning"


def at_least(found: Severity, minimum: Severity) -> bool:
    return SEVERITIES.index(found) >= SEVERITIES.index(minimum)


# --- signatures ------------------------------------------------------------------------------------------


class SignatureError(PermanentError):
    """A delivery whose signature header is missing, malformed, wrong, or outside the replay window."""


def _digest(secret: str, timestamp: int, body: bytes) -> str:
    signed = str(timestamp).encode() + b"." + body
    return hmac.new(secret.encode(), signed, hashlib.sha256).hexdigest()


def sign(secret: str, body: bytes, timestamp: int | None = None) -> str:
    """The `Vigil-Signature` header's value for `body`, signed now (or at `timestamp`, unix seconds)."""
    t = int(time.time()) if timestamp is None else timestamp
    return f"t={t},{SCHEME}={_digest(secret, t, body)}"


def verify(
    secret: str,
    header: str | None,
    body: bytes,
    tolerance_s: float = DEFAULT_TOLERANCE_S,
    *,
    now: float | None = None,
) -> int:
    """Check a delivery: its `Vigil-Signature` header against the body as received (bytes, before any
    JSON parsing) and the route's secret. Returns the signed timestamp; raises SignatureError when the
    header is missing or malformed, no `v1` signature matches, or the timestamp is more than
    `tolerance_s` from `now` (a replay)."""
    if not header:
        raise SignatureError(f"no {SIGNATURE_HEADER} header")
    timestamp: int | None = None
    given: list[str] = []
    for part in header.split(","):
        key, _, value = part.strip().partition("=")
        if key == "t":
            try:
                timestamp = int(value)
            except ValueError:
                raise SignatureError(f"{SIGNATURE_HEADER}: t={value!r} is not unix seconds") from None
        elif key == SCHEME:
            given.append(value)
    if timestamp is None or not given:
        raise SignatureError(f"{SIGNATURE_HEADER} must be 't=<unix seconds>,{SCHEME}=<hex>', got {header!r}")
    expected = _digest(secret, timestamp, body)
    if not any(hmac.compare_digest(expected, g) for g in given):
        raise SignatureError("the signature does not match the body and secret")
    age = (time.time() if now is None else now) - timestamp
    if abs(age) > tolerance_s:
        raise SignatureError(f"signed {age:.0f}s from now, outside the {tolerance_s:.0f}s replay window")
    return timestamp
