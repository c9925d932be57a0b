"""A guardian settings change, validated as the spec's guardian section is (`guardian_settings.changed_section`),
and the CLI's `key=value` reading of it."""

from __future__ import annotations

import click
import pytest

from vigil.errors import SpecError
from vigil.spec import JobSpec
from vigil_cli.guardian import setting
from vigil_scheduler.guardian_settings import changed_section

SPEC = JobSpec(name="t", guardian={"spike_zscore": 50.0, "hang_timeout_s": 30.0}).model_dump(mode="json")


def fields(exc: pytest.ExceptionInfo[SpecError]) -> list[str]:
    return [e["field"] for e in exc.value.errors]


def test_a_change_keeps_the_rest_of_the_section() -> None:
    section = changed_section(SPEC, {"spike_zscore": 4, "spike": "halt"})
    assert (section.spike_zscore, section.spike, section.hang_timeout_s) == (4.0, "halt", 30.0)


@pytest.mark.parametrize(
    ("changes", "field"),
    [
        ({"spike_zscor": 4.0}, "guardian.spike_zscor"),  # unknown
        ({"spike_zscore": -1.0}, "guardian.spike_zscore"),  # out of range
        ({"spike": "reboot"}, "guardian.spike"),  # no such action
        ({"spike_window": "50"}, "guardian.spike_window"),  # not coerced, as in a spec
        ({"hang_floor_s": 45.0}, "guardian.hang_floor_s"),  # above the job's hang_timeout_s (30)
        ({}, "guardian"),  # nothing to change
    ],
)
def test_a_bad_change_names_its_field(changes: dict, field: str) -> None:
    with pytest.raises(SpecError) as exc:
        changed_section(SPEC, changes)
    assert fields(exc) == [field], exc.value.errors


@pytest.mark.parametrize(
    ("text", "pair"),
    [
        ("spike_zscore=4", ("spike_zscore", 4)),
        ("spike_zscore=4.5", ("spike_zscore", 4.5)),
        ("spike=halt", ("spike", "halt")),
        ("replay=false", ("replay", False)),
        ("hang_floor_s=null", ("hang_floor_s", None)),
        ("hang_floor_s=", ("hang_floor_s", None)),
    ],
)
def test_the_cli_reads_a_value_as_the_spec_would(text: str, pair: tuple) -> None:
    assert setting(text) == pair


@pytest.mark.parametrize("text", ["spike_zscore", "=4", "spike=[1, 2]", "spike={a: 1}"])
def test_the_cli_refuses_what_is_not_one_key_and_value(text: str) -> None:
    with pytest.raises(click.BadParameter):
        setting(text)
