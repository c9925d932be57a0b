"""A user program's replay reports are evidence, never a verdict: they ask the worker to check the device
(`DiagnoseDevice`), and only the worker's failed check (`DeviceDiagnosed`) excludes it. The built-in
trainer's replays strike as before (tests/unit/guardian/test_watch.py)."""

from __future__ import annotations

from tests.unit.guardian.helpers import JOB, at, launch
from tests.unit.guardian.test_watch import ckpt, feed, normal_steps, replayed
from vigil.events import DeviceDiagnosed, DiagnoseDevice, LaunchJob
from vigil.spec import JobSpec
from vigil_guardian.core import Guardian
from vigil_guardian.replays import DIAGNOSES_MAX


def user_program_launch(world: int = 2, **guardian: object) -> LaunchJob:
    base = launch(world, **guardian)
    fields = base.spec.model_dump(mode="json", exclude={"model"})
    spec = JobSpec.model_validate({**fields, "entrypoint": {"argv": ["python", "train.py"]}})
    return base.model_copy(update={"spec": spec})


def started_user_program(**guardian: object) -> Guardian:
    g = Guardian()
    feed(g, [user_program_launch(**guardian), ckpt(0), ckpt(5, 0.55)])
    feed(g, normal_steps(0, 12))
    return g


def diagnosed(passed: bool | None, *, node: str = "n1", t: float = 2.0, **kw: object) -> DeviceDiagnosed:
    return DeviceDiagnosed(
        job_id=JOB,
        attempt=1,
        node=node,
        device=0,
        passed=passed,
        checks={"matmul": 0.0 if passed else 0.5},
        duration_s=0.3,
        command_id="c",
        occurred_at=at(t),
        **kw,  # type: ignore[arg-type]
    )


def test_two_fake_transient_replays_of_a_user_program_strike_nothing_and_ask_for_one_check():
    g = started_user_program(sdc_strikes=2)
    first = feed(g, [replayed(6, t=0.7)])
    second = feed(g, [replayed(11, t=1.2)])
    assert [d.action for d in first + second] == ["replay", "replay"]  # no sdc verdict, no restart
    (ask,) = first[0].commands
    assert isinstance(ask, DiagnoseDevice) and (ask.node, ask.device) == ("n1", 0)
    assert second[0].commands == ()  # that device is asked about once per attempt
    inc = first[0].incident
    assert inc.evidence["vouched"] is False and inc.evidence["diagnose"] == [["n1", 0]]
    assert "not a strike" in inc.message
    assert g.jobs[JOB].control.strikes == {}


def test_a_passed_check_is_an_alert_that_marks_nothing():
    g = started_user_program(sdc_strikes=1)
    feed(g, [replayed(6, t=0.7)])
    (d,) = feed(g, [diagnosed(True)])
    assert (d.incident.kind, d.action, d.commands) == ("sdc", "alert", ())
    assert d.incident.device is None and d.incident.evidence["device"] == 0  # the scheduler marks nothing
    assert "not upheld" in d.incident.message


def test_a_failed_check_relaunches_the_job_without_the_device():
    g = started_user_program()
    feed(g, [replayed(6, t=0.7)])
    (d,) = feed(g, [diagnosed(False)])
    assert (d.incident.kind, d.action) == ("sdc", "restart")
    (restart,) = d.commands
    assert restart.type == "job.restart" and restart.unhealthy == [("n1", 0)] and restart.step == 5
    assert "failed the worker's known-answer check" in d.incident.message


def test_a_check_that_could_not_run_is_inconclusive():
    g = started_user_program()
    feed(g, [replayed(6, t=0.7)])
    (d,) = feed(g, [diagnosed(None, error="CUDA out of memory")])
    assert d.action == "alert" and d.commands == () and "could not run" in d.incident.message


def test_a_job_asks_for_at_most_DIAGNOSES_MAX_checks():
    g = Guardian()
    world = DIAGNOSES_MAX + 4
    feed(g, [user_program_launch(world), ckpt(0)])
    asked = []
    for rank in range(world):
        for d in feed(g, [replayed(rank + 1, rank=rank, t=0.1 * (rank + 1))]):
            asked += d.commands
    assert len(asked) == DIAGNOSES_MAX


def test_the_built_in_trainers_replays_still_strike():
    g = Guardian()
    feed(g, [launch(2, sdc_strikes=2), ckpt(0), ckpt(5, 0.55)])
    feed(g, normal_steps(0, 12))
    out = feed(g, [replayed(6, t=0.7)]) + feed(g, [replayed(11, t=1.2)])
    assert [d.action for d in out] == ["replay", "replay", "restart"]
    assert all(not isinstance(c, DiagnoseDevice) for d in out for c in d.commands)
