"""The one redaction rule for URLs that may carry credentials."""

from __future__ import annotations

import pytest

from vigil_common.redact import has_secret, redact_text, redact_url


@pytest.mark.parametrize(
    ("url", "shown"),
    [
        ("nats://vigil:s3cret@nats:4222", "nats://vigil:***@nats:4222"),
        ("nats://s3cret-token@nats:4222", "nats://***@nats:4222"),
        ("tls://a:b@h:1,tls://c:d@h:2", "tls://a:***@h:1,tls://c:***@h:2"),
        ("postgresql://vigil:p%40ss@db:5432/vigil", "postgresql://vigil:***@db:5432/vigil"),
        (
            "postgresql://vigil@db/vigil?password=pw&sslmode=require",
            "postgresql://vigil@db/vigil?password=***&sslmode=require",
        ),
        ("postgresql://postgres@127.0.0.1:5432/postgres", "postgresql://postgres@127.0.0.1:5432/postgres"),
        ("nats://127.0.0.1:4222", "nats://127.0.0.1:4222"),
    ],
)
def test_passwords_and_tokens_are_masked_and_nothing_else(url: str, shown: str) -> None:
    assert redact_url(url) == shown
    assert has_secret(url) == (url != shown)


def test_free_text_quoting_a_url_is_masked() -> None:
    text = "cannot reach NATS at nats://u:pw@h:4222: nats: no servers (nats://u:pw@h:4222)"
    assert "pw" not in redact_text(text) and redact_text(text).count("u:***@") == 2
    assert redact_url(None) == ""


def test_private_dirs_are_owner_only_but_keep_a_search_bit(tmp_path) -> None:
    import stat

    from vigil.paths import private_dir

    fresh = private_dir(tmp_path / "a" / "data")
    assert stat.S_IMODE(fresh.stat().st_mode) == 0o700
    loose = tmp_path / "loose"
    loose.mkdir(mode=0o777)
    loose.chmod(0o777)
    assert stat.S_IMODE(private_dir(loose).stat().st_mode) == 0o711
