"""`vigil.alerts`: severity from kind and action, and the Stripe-style signature a receiver verifies."""

from __future__ import annotations

import pytest

from vigil.alerts import SEVERITIES, SignatureError, at_least, severity, sign, verify

SECRET = "vgw_test-secret"
BODY = b'{"kind":"nan","job_id":"j-1"}'
T = 1_800_000_000


def test_severity_follows_what_was_done():
    assert severity("nan", "fail") == "critical"
    assert severity("spike", "rollback") == severity("hang", "restart") == severity("nan", "halt") == "error"
    assert severity("straggler", "alert") == severity("sdc", "replay") == "warning"
    assert severity("preemption", "alert") == severity("time_limit", "halt") == "info"
    assert SEVERITIES == ("info", "warning", "error", "critical")
    assert at_least("error", "warning") and at_least("info", "info") and not at_least("warning", "error")


def test_a_signed_body_verifies_and_returns_its_time():
    header = sign(SECRET, BODY, timestamp=T)
    assert header.startswith(f"t={T},v1=") and len(header.split("v1=")[1]) == 64
    assert verify(SECRET, header, BODY, now=T + 10) == T


@pytest.mark.parametrize(
    ("secret", "body", "header", "now", "says"),
    [
        (SECRET, BODY + b" ", None, T, "does not match"),  # a tampered body
        ("vgw_other", BODY, None, T, "does not match"),  # another route's secret
        (SECRET, BODY, None, T + 301, "replay window"),  # replayed later
        (SECRET, BODY, None, T - 301, "replay window"),  # from the future
        (SECRET, BODY, "", T, "no Vigil-Signature"),
        (SECRET, BODY, f"t={T}", T, "must be"),
        (SECRET, BODY, "t=soon,v1=00", T, "unix seconds"),
        (SECRET, BODY, f"t={T + 1},v1=" + "0" * 64, T, "does not match"),  # a timestamp moved
    ],
)
def test_a_bad_delivery_is_refused(secret, body, header, now, says):
    given = sign(SECRET, BODY, timestamp=T) if header is None else header
    with pytest.raises(SignatureError, match=says):
        verify(secret, given, body, tolerance_s=300, now=now)


def test_any_of_several_signatures_may_match():
    right = sign(SECRET, BODY, timestamp=T).split(",")[1]
    assert verify(SECRET, f"t={T},v1={'0' * 64},{right}", BODY, now=T) == T
