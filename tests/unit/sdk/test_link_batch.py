"""`VIGIL_LINK_BATCH_S`: how long fast steps may wait to go out together."""

from __future__ import annotations

import pytest

from vigil.link import LINK_BATCH_S, batch_from_env


def test_the_batch_window_comes_from_the_environment_and_a_bad_one_is_named(monkeypatch):
    monkeypatch.delenv("VIGIL_LINK_BATCH_S", raising=False)
    assert batch_from_env() == LINK_BATCH_S
    monkeypatch.setenv("VIGIL_LINK_BATCH_S", "0")
    assert batch_from_env() == 0.0
    monkeypatch.setenv("VIGIL_LINK_BATCH_S", "0.2")
    assert batch_from_env() == 0.2
    for bad in ("soon", "-1", "60"):
        monkeypatch.setenv("VIGIL_LINK_BATCH_S", bad)
        with pytest.raises(ValueError, match=f"VIGIL_LINK_BATCH_S={bad!r}"):
            batch_from_env()
