"""Every member of the guardian's input union reaches a branch of its receivers' `match` (mypy checks the
same statically, `assert_never`): none falls through to the default branch at run time."""

from typing import get_args

import pytest

from tests.unit.common.samples import SAMPLES, T0
from vigil import events as ev
from vigil.errors import MalformedMessage
from vigil_guardian.core import Guardian
from vigil_guardian.watch import JobWatch


@pytest.mark.parametrize("cls", get_args(ev.GuardianInput), ids=lambda c: c.__name__)
def test_each_member_of_the_guardians_input_is_judged(cls):
    g = Guardian()
    g.on_event(SAMPLES[ev.LaunchJob], T0)
    assert isinstance(g.on_event(SAMPLES[cls], T0), list)


@pytest.mark.parametrize("cls", ev.STATUS_EVENTS, ids=lambda c: c.__name__)
def test_each_status_event_has_its_branch_in_on_status(cls):
    watch = JobWatch("j-0123456789ab")
    watch.on_launch(SAMPLES[ev.LaunchJob])
    assert isinstance(watch.on_status(SAMPLES[cls], T0), list)


def test_a_message_outside_the_union_is_refused_by_name():
    with pytest.raises(MalformedMessage, match=r"HaltJob .* is not a guardian input"):
        ev.expect(SAMPLES[ev.HaltJob], ev.is_guardian_input, "guardian input")
