"""Settings changed on a running job (`GuardianSettingsChanged`): the guardian judges the steps after the
change under them, says from which step in its state and in every incident, and a later launch does not
undo them."""

from __future__ import annotations

from typing import Any

from tests.unit.guardian.helpers import JOB, at, launch, step
from vigil.events import GuardianSettingsChanged
from vigil.spec import GuardianSpec
from vigil_guardian.state import Control
from vigil_guardian.watch import JobWatch

LOOSE = {"spike_zscore": 1000.0, "spike_warmup": 5, "spike": "alert"}


def changed(revision: int = 1, **fields: Any) -> GuardianSettingsChanged:
    return GuardianSettingsChanged(
        job_id=JOB,
        attempt=1,
        occurred_at=at(100),
        revision=revision,
        settings=GuardianSpec(**{**LOOSE, **fields}),
        changed=fields,
        by="user:alice",
    )


def wiggle(k: int) -> float:
    return 2.0 + 0.01 * (k % 3 - 1)


def running(until: int) -> JobWatch:
    w = JobWatch(JOB)
    w.on_launch(launch(world=1, **LOOSE))
    for k in range(until):
        assert w.on_step(step(k, loss=wiggle(k)), at(k)) == []
    return w


def test_a_lowered_spike_threshold_catches_the_spike_the_spec_let_pass() -> None:
    w = running(20)
    assert w.on_step(step(20, loss=3.0), at(20)) == []  # z ~ 100: under 1000, let pass
    w.on_status(changed(spike_zscore=6.0), at(21))
    assert w.control.spec.spike_zscore == 6.0 and w.control.retuned is not None
    assert w.control.retuned.from_step is None  # no step judged under it yet
    for k in range(21, 25):
        assert w.on_step(step(k, loss=wiggle(k)), at(k)) == []
    (d,) = w.on_step(step(25, loss=3.0), at(25))  # the same spike, caught
    assert (d.incident.kind, d.incident.step, d.action) == ("spike", 25, "alert")
    assert d.incident.evidence["guardian_settings"] == {
        "revision": 1,
        "from_step": 21,
        "changed": {"spike_zscore": 6.0},
    }


def test_the_change_survives_a_restart_and_a_later_launch() -> None:
    w = running(12)
    w.on_status(changed(spike_zscore=6.0, spike="halt"), at(12))
    w.on_step(step(12, loss=wiggle(12)), at(12))
    restored = JobWatch(JOB, Control.restore(w.control.snapshot()))  # what a restart or a hand-over loads
    assert restored.control.retuned == w.control.retuned and restored.control.spec == w.control.spec
    restored.on_launch(launch(world=1, attempt=2, **LOOSE))  # built before the change, stored after it
    assert restored.control.spec.spike_zscore == 6.0 and restored.control.spec.spike == "halt"


def test_an_older_or_repeated_change_is_ignored() -> None:
    w = running(12)
    w.on_status(changed(2, spike_zscore=6.0), at(12))
    w.on_status(changed(1, spike_zscore=9.0), at(12))  # a redelivery of an earlier one
    w.on_status(changed(2, spike_zscore=9.0), at(12))
    assert w.control.spec.spike_zscore == 6.0 and w.control.retuned is not None
    assert w.control.retuned.revision == 2


def test_a_quiet_step_does_not_say_where_the_change_applies() -> None:
    """A re-feed after a restart feeds older steps quietly: none of them is the step the change applied from."""
    w = running(12)
    w.on_status(changed(spike_zscore=6.0), at(12))
    w.on_step(step(3, loss=wiggle(3)), at(3), quiet=True)
    assert w.control.retuned is not None and w.control.retuned.from_step is None


def test_a_restart_does_not_count_a_spike_the_old_settings_let_pass_as_an_episode() -> None:
    """The re-feed after a restart judges the steps before the change under the new settings: a spike they
    let pass must not hold back (as its episode) the incident of one the new settings catch."""
    w = running(20)
    w.on_step(step(20, loss=3.0), at(20))  # let pass
    w.on_status(changed(spike_zscore=6.0), at(21))
    for k in range(21, 23):
        w.on_step(step(k, loss=wiggle(k)), at(k))
    restored = JobWatch(JOB, Control.restore(w.control.snapshot()))
    for k in range(23):  # the re-feed: quiet
        restored.on_step(step(k, loss=3.0 if k == 20 else wiggle(k)), at(k), quiet=True)
    for k in range(23, 25):
        assert restored.on_step(step(k, loss=wiggle(k)), at(k)) == []
    (d,) = restored.on_step(step(25, loss=3.0), at(25))  # within 5 steps of step 20's spike
    assert (d.incident.kind, d.incident.step) == ("spike", 25)
