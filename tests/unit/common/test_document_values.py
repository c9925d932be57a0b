"""Values YAML's constructors cannot build, and numbers too long to be a spec's, are refused naming
their field (never a ValueError, KeyError or AttributeError out of the parser, which the gateway would
answer with a 500), in a bounded time."""

from __future__ import annotations

import time
from datetime import date

import pytest

from vigil.documents import MAX_NUMBER_CHARS, DocumentError, load
from vigil.errors import SpecError
from vigil.spec import parse_spec


@pytest.mark.parametrize(
    ("text", "field", "says"),
    [
        ("name: 2001-13-14", "name", "timestamp"),
        ("name: !!int 0b", "name", "int"),
        ("x: !!timestamp soon", "x", "timestamp"),
        ("x: !!bool perhaps", "x", "bool"),
        ("x: !!float abc", "x", "float"),
        ("a: [1, {b: !!int z}]", "a.1.b", "int"),
        ("2001-02-30: x", "2001-02-30", "timestamp"),
        ("a: &x [1, !!int 0x]\nb: *x", "a.1", "int"),
        ("train: {steps: " + "9" * 5000 + "}", "train.steps", f"more than {MAX_NUMBER_CHARS} characters"),
        ("train: {lr: 0." + "1" * 200 + "}", "train.lr", f"more than {MAX_NUMBER_CHARS} characters"),
    ],
)
def test_an_unbuildable_yaml_value_names_its_field(text: str, field: str, says: str) -> None:
    with pytest.raises(DocumentError) as info:
        load(text)
    assert info.value.field == field and says in str(info.value), str(info.value)


@pytest.mark.parametrize(
    ("text", "field"),
    [
        ('{"train": {"steps": ' + "9" * 5000 + "}}", "train.steps"),
        ('{"faults": [{"step": 1}, {"step": -' + "1" * 200 + "}]}", "faults.1.step"),
        ('{"lr": 1.' + "0" * 200 + "}", "lr"),
    ],
)
def test_a_json_number_too_long_names_its_field(text: str, field: str) -> None:
    with pytest.raises(DocumentError) as info:
        load(text, json_only=True)
    assert info.value.field == field


def test_a_sexagesimal_megabyte_is_refused_at_once() -> None:
    """YAML 1.1 reads `1:0:0:...` as a base-60 integer, built in quadratic time (40 s for 1 MB)."""
    t0 = time.monotonic()
    with pytest.raises(DocumentError) as info:
        load("train: {steps: 1" + ":0" * 500_000 + "}")
    # a wide margin for a loaded machine: the quadratic read took 40 s; refused, it takes milliseconds
    assert info.value.field == "train.steps" and time.monotonic() - t0 < 10.0


def test_ordinary_values_still_read() -> None:
    assert load("a: 2001-12-14\nb: !!int '0b101'\nc: 3e-4\nd: 1:30\ne: 0x1F") == {
        "a": date(2001, 12, 14),
        "b": 5,
        "c": 3e-4,
        "d": 90,
        "e": 31,
    }


@pytest.mark.parametrize(
    ("text", "content_type", "field"),
    [
        ("name: 2001-13-14\n", None, "name"),
        ("name: t\ntrain: {steps: " + "9" * 5000 + "}\n", None, "train.steps"),
        ('{"name": "t", "train": {"steps": ' + "9" * 5000 + "}}", "application/json", "train.steps"),
    ],
)
def test_the_spec_parser_turns_them_into_spec_errors(text: str, content_type: str | None, field: str) -> None:
    with pytest.raises(SpecError) as info:
        parse_spec(text, content_type=content_type)
    assert [e["field"] for e in info.value.errors] == [field]
