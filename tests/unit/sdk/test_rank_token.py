"""The rank's token comes on an inherited pipe, read once: the descriptor is closed and its variable
dropped, so nothing the rank starts inherits either, and the token is never in the environment."""

from __future__ import annotations

import os

import pytest

from vigil import link
from vigil import protocol as proto


def test_the_token_is_read_once_from_its_pipe_and_the_pipe_is_closed(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setattr(link, "_token", None)
    read_end, write_end = os.pipe()
    os.write(write_end, b"t0ken-0123456789abcdef")
    os.close(write_end)
    monkeypatch.setenv(proto.RANK_TOKEN_FD_ENV, str(read_end))
    assert link.rank_token() == "t0ken-0123456789abcdef"
    assert proto.RANK_TOKEN_FD_ENV not in os.environ
    with pytest.raises(OSError):
        os.fstat(read_end)  # closed
    assert link.rank_token() == "t0ken-0123456789abcdef"  # kept, for reconnecting
    assert not [k for k, v in os.environ.items() if "t0ken" in v]


def test_outside_vigil_there_is_no_token(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setattr(link, "_token", None)
    monkeypatch.delenv(proto.RANK_TOKEN_FD_ENV, raising=False)
    assert link.rank_token() is None
    assert link.connect_from_env("j", 1, 0) is None
