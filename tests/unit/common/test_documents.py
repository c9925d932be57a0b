"""Untrusted YAML and JSON: bounded depth, size and time, duplicate keys refused, before anything is built."""

from __future__ import annotations

import contextlib
import time

import pytest

from vigil.documents import MAX_DEPTH, MAX_NODES, DocumentError, load


def refused(text: str, **kw: bool) -> DocumentError:
    with pytest.raises(DocumentError) as info:
        load(text, **kw)
    return info.value


@pytest.mark.parametrize("json_only", [False, True])
def test_deep_nesting_is_refused_not_a_recursion_error(json_only: bool) -> None:
    for depth in (MAX_DEPTH + 1, 100_000, 1 << 20):
        assert "nested deeper" in str(refused("[" * depth + "]" * depth, json_only=json_only))
    assert load("[" * (MAX_DEPTH - 1) + "]" * (MAX_DEPTH - 1), json_only=json_only) is not None


def test_block_style_nesting_is_counted_too() -> None:
    text = "".join(" " * i + f"k{i}:\n" for i in range(MAX_DEPTH + 2)) + " " * (MAX_DEPTH + 2) + "v"
    assert "nested deeper" in str(refused(text))


@pytest.mark.parametrize("json_only", [False, True])
def test_too_many_values_are_refused(json_only: bool) -> None:
    text = "[" + ",".join("1" for _ in range(MAX_NODES + 1)) + "]"
    assert "more than" in str(refused(text, json_only=json_only))


def test_alias_expansion_counts_the_nodes_it_repeats() -> None:
    # "billion laughs": each level repeats the previous one ten times
    levels = ["a0: &a0 [x, x, x, x, x, x, x, x, x, x]"]
    levels += [f"a{i}: &a{i} [{', '.join([f'*a{i - 1}'] * 10)}]" for i in range(1, 9)]
    error = refused("\n".join(levels))
    assert "more than" in str(error) and error.field.startswith("a")


def test_duplicate_keys_name_where_they_are() -> None:
    error = refused("train:\n  steps: 1\n  lr: 0.1\n  steps: 2\n")
    assert error.field == "train.steps" and "line 4" in str(error)
    assert refused("faults:\n  - {kind: nan, kind: spike}\n").field == "faults.0.kind"
    assert refused('{"a": 1, "a": 2}', json_only=True).field == "(spec)"


def test_a_megabyte_is_read_or_refused_quickly() -> None:
    bodies = [
        "name: t\nfaults:\n" + "".join(f"  - {{kind: nan, step: {i}}}\n" for i in range(40_000)),
        "name: t\nnote: '" + "x" * (1 << 20) + "'\n",
        "# " + "c" * (1 << 20) + "\nname: t\n",
        "[" * (1 << 20),
    ]
    for body in bodies:
        t0 = time.monotonic()
        with contextlib.suppress(DocumentError):
            load(body)
        assert time.monotonic() - t0 < 5.0  # was 16 s for such a body; generous for a loaded machine


def test_merge_keys_and_plain_documents_still_load() -> None:
    assert load("base: &b {x: 1}\nother:\n  <<: *b\n  y: 2\n") == {
        "base": {"x": 1},
        "other": {"x": 1, "y": 2},
    }
