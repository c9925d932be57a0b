import json
import math
from pathlib import Path

import pytest

from tests.unit.common.samples import SAMPLES
from vigil import events as ev
from vigil.client import _event
from vigil.errors import MalformedMessage
from vigil_common import subjects

GOLDEN = Path(__file__).parent / "golden"


def test_every_event_class_has_a_sample_and_a_golden_file():
    assert set(SAMPLES) == set(ev.EVENT_CLASSES)
    names = {
        f"{cls.model_fields['type'].default}.v{cls.model_fields['schema_version'].default}.json"
        for cls in ev.EVENT_CLASSES
    }
    assert names == {p.name for p in GOLDEN.glob("*.json")}


@pytest.mark.parametrize("cls", ev.EVENT_CLASSES, ids=lambda c: c.__name__)
def test_golden_json_round_trips(cls):
    sample = SAMPLES[cls]
    golden = json.loads((GOLDEN / f"{sample.type}.v{sample.schema_version}.json").read_text())
    # The wire format of a released version never changes: the sample serialises to the golden file...
    assert json.loads(sample.to_bytes()) == golden
    # ...and the golden file decodes to the same event, as the current version of its type.
    assert ev.decode(json.dumps(golden).encode()) == sample.upgraded()


def test_step_completed_v1_is_read_as_v3_with_its_finiteness_unknown_and_a_first_run():
    golden = (GOLDEN / "step.completed.v1.json").read_bytes()
    for expected in (None, subjects.CARRIES["step"]):
        step = ev.decode(golden, expected)
        assert isinstance(step, ev.StepCompleted) and step.schema_version == 3
        assert step.local_finite is None and step.mfu is None and step.generation == 0
        assert step.loss == 2.5 and step.rank == 1 and step.event_id == SAMPLES[ev.StepCompletedV1].event_id


def test_step_completed_v2_is_read_as_v3_of_generation_0():
    golden = (GOLDEN / "step.completed.v2.json").read_bytes()
    for expected in (None, subjects.CARRIES["step"]):
        step = ev.decode(golden, expected)
        assert isinstance(step, ev.StepCompleted) and step.schema_version == 3
        assert step.generation == 0  # a v2 sender numbered no rollbacks: the attempt's first run
        assert step.local_finite is True and step.mfu == 0.41 and step.micro_batch == 4
        assert step.model_dump(exclude={"schema_version", "generation"}) == SAMPLES[
            ev.StepCompletedV2
        ].model_dump(exclude={"schema_version"})


def test_step_completed_v3_carries_its_generation_and_bounds_it():
    raw = json.loads((GOLDEN / "step.completed.v3.json").read_text())
    assert ev.decode(json.dumps(raw).encode(), subjects.CARRIES["step"]).generation == 1
    del raw["generation"]  # optional: a v3 sender that leaves it out reports a first run
    assert ev.decode(json.dumps(raw).encode(), subjects.CARRIES["step"]).generation == 0
    for bad in (-1, 2**31, "two"):
        with pytest.raises(MalformedMessage, match="generation"):
            ev.decode(json.dumps({**raw, "generation": bad}).encode(), subjects.CARRIES["step"])


def test_step_completed_v2_requires_the_ranks_own_finiteness():
    raw = json.loads((GOLDEN / "step.completed.v2.json").read_text())
    del raw["local_finite"]
    with pytest.raises(MalformedMessage, match="local_finite"):
        ev.decode(json.dumps(raw).encode(), subjects.CARRIES["step"])


def test_non_finite_floats_survive_the_wire():
    step = SAMPLES[ev.StepCompleted].model_copy(update={"loss": float("nan"), "grad_norm": float("inf")})
    raw = step.to_bytes()
    json.loads(raw)  # still standard JSON
    back = ev.decode(raw, subjects.CARRIES["step"])
    assert math.isnan(back.loss) and back.grad_norm == float("inf")


def test_decode_names_the_bad_field():
    golden = json.loads((GOLDEN / "step.completed.v1.json").read_text())
    golden["rank"] = -1
    with pytest.raises(MalformedMessage, match="rank"):
        ev.decode(json.dumps(golden).encode())


def test_decode_rejects_unknown_fields_types_and_versions():
    golden = json.loads((GOLDEN / "job.halt.v1.json").read_text())
    with pytest.raises(MalformedMessage, match="surprise"):
        ev.decode(json.dumps({**golden, "surprise": 1}).encode())
    with pytest.raises(MalformedMessage, match="unknown message type"):
        ev.decode(json.dumps({**golden, "schema_version": 99}).encode())
    with pytest.raises(MalformedMessage, match="not JSON"):
        ev.decode(b"{nope")
    with pytest.raises(MalformedMessage, match="not carried on this subject"):
        ev.decode(json.dumps(golden).encode(), (ev.StepCompleted,))


def test_envelope_defaults_are_fresh_and_utc():
    a, b = ev.CancelJob(job_id="j1"), ev.CancelJob(job_id="j1")
    assert a.event_id != b.event_id
    assert a.occurred_at.utcoffset().total_seconds() == 0


def test_job_id_must_be_a_subject_token():
    with pytest.raises(ValueError, match="job_id"):
        ev.CancelJob(job_id="bad.id")


def test_incident_v1_is_read_as_v2_a_relaunch_as_a_restart():
    golden = json.loads((GOLDEN / "incident.raised.v1.json").read_text())
    rollback = ev.decode(json.dumps(golden).encode(), ev.INCIDENTS)
    assert isinstance(rollback, ev.IncidentRaised) and rollback.schema_version == 2
    assert rollback.action == "rollback"  # in place: its evidence does not say restart
    # v1 said "rollback" for a relaunch too, and its evidence said which: read as v2's "restart"
    relaunch = {**golden, "kind": "hang", "evidence": {"restart": True, "checkpoint_step": 4}}
    restart = ev.decode(json.dumps(relaunch).encode(), ev.INCIDENTS)
    assert (restart.action, restart.kind, restart.event_id) == ("restart", "hang", golden["event_id"])
    assert ev.decode(json.dumps({**golden, "action": "halt"}).encode(), ev.INCIDENTS).action == "halt"
    with pytest.raises(MalformedMessage, match="action"):  # v1 never carried "restart"
        ev.decode(json.dumps({**golden, "action": "restart"}).encode(), ev.INCIDENTS)


# Older versions a subject still carries: each is read as a member of its subject's union.
OLDER = {ev.StepCompletedV1, ev.StepCompletedV2, ev.RollbackJobV1, ev.IncidentRaisedV1}


@pytest.mark.parametrize(
    "union, members",
    [
        (ev.StatusEvent, ev.STATUS_EVENTS),
        (ev.JobCommand, ev.JOB_COMMANDS),
        (ev.IncidentRaised, ev.INCIDENTS),
    ],
    ids=["status", "cmd", "incident"],
)
def test_each_subject_carries_its_union_and_older_versions_only(union, members):
    current = set(getattr(union, "__args__", (union,)))
    assert set(members) - OLDER == current
    for cls in set(members) & OLDER:  # an older version's sample upgrades to a member of the union
        assert type(SAMPLES[cls].upgraded()) in current


def test_every_status_event_and_command_is_in_a_receivers_union():
    stream = set(ev.JobStreamEvent.__args__)
    assert set(ev.STATUS_EVENTS) | {ev.LaunchJob, ev.StepCompleted} == stream
    assert stream | {ev.GpuSampled} == set(ev.GuardianInput.__args__)
    for sample in SAMPLES.values():
        current = sample.upgraded()
        assert ev.is_status(current) == isinstance(current, ev.STATUS_EVENTS)
        assert ev.is_guardian_input(current) == (type(current) in set(ev.GuardianInput.__args__))
        assert ev.is_telemetry_input(current) == (type(current) in set(ev.TelemetryInput.__args__))


def test_expect_refuses_another_receivers_message_by_name():
    status = SAMPLES[ev.RankStarted]
    assert ev.expect(status, ev.is_status, "status event") is status
    with pytest.raises(MalformedMessage, match=r"HaltJob \(job.halt\) is not a status event: refused"):
        ev.expect(SAMPLES[ev.HaltJob], ev.is_status, "status event")


def test_the_sdk_client_reads_an_older_gateways_v1_incidents_as_v2():
    golden = json.loads((GOLDEN / "incident.raised.v1.json").read_text())
    relaunch = {**golden, "evidence": {"restart": True}}
    assert _event("incident.raised", json.dumps(relaunch)).action == "restart"
    current = SAMPLES[ev.IncidentRaised]
    assert _event("incident.raised", current.to_bytes().decode()) == current
