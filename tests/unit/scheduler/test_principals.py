"""Principals, pure: who sees a job, how tokens are made and hashed, and the file of users refused with the
field named."""

from __future__ import annotations

import pytest

from vigil.errors import ConfigError
from vigil_scheduler.principals import (
    admin_principal,
    new_token,
    parse_users_file,
    token_sha256,
    user_principal,
)


def test_a_user_sees_its_own_and_its_teams_jobs_an_admin_all() -> None:
    alice = user_principal("alice", "vision", admin=False)
    assert alice.sees("alice", None) and alice.sees("bob", "vision")
    assert not alice.sees("carol", "nlp") and not alice.sees("carol", None)
    loner = user_principal("dan", None, admin=False)
    assert loner.sees("dan", None) and not loner.sees("eve", None)  # no team: no team's jobs
    assert admin_principal("t" * 32).sees("carol", "nlp")
    assert alice.actor == "user:alice" and admin_principal("t" * 32).actor.startswith("token:")


def test_tokens_are_random_and_only_their_hash_is_kept() -> None:
    a, b = new_token(), new_token()
    assert a != b and len(a) >= 40
    assert token_sha256(a) == token_sha256(a + "\n") and len(token_sha256(a)) == 64
    assert a not in token_sha256(a)


def test_the_users_file_reads_yaml_and_json() -> None:
    digest = token_sha256(new_token())
    users = parse_users_file(
        f"users:\n  - {{name: alice, team: vision, gpus: 4, token_sha256: {digest}}}\nteams: [{{name: vision, gpus: 8}}]"
    )
    assert users.users[0].token_sha256 == [digest] and users.teams[0].gpus == 8
    assert users.teams[0].share is None  # unset: the share stays as the API set it
    assert parse_users_file("teams: [{name: nlp, share: 3}]").teams[0].share == 3.0
    assert parse_users_file('{"users": [{"name": "bob", "admin": true}]}').users[0].admin


@pytest.mark.parametrize(
    ("text", "named"),
    [
        ("users: [{name: Alice}]", "users.0.name"),
        ("users: [{name: admin}]", "users.0.name"),
        ("users: [{name: a, token_sha256: not-a-hash}]", "users.0.token_sha256"),
        ("users: [{name: a, gpus: -1}]", "users.0.gpus"),
        ("users: [{name: a, password: x}]", "users.0.password"),
        ("teams: [{name: 'a b'}]", "teams.0.name"),
        ("teams: [{name: a, share: 0}]", "teams.0.share"),
        ("teams: [{name: a, share: .inf}]", "teams.0.share"),
        ("users: [{name: a}, {name: a}]", "more than once"),
        ("users: [", "not YAML"),
    ],
)
def test_a_bad_users_file_is_refused_naming_the_field(text: str, named: str) -> None:
    with pytest.raises(ConfigError, match="VIGIL_USERS_FILE") as refused:
        parse_users_file(text)
    assert named in str(refused.value)
