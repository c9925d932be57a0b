from tests.unit.guardian.helpers import JOB, T0
from vigil.spec import GuardianSpec
from vigil_common import subjects
from vigil_guardian.policy import Policy, incident_id, rollback_target
from vigil_guardian.service import outgoing
from vigil_guardian.verdict import Verdict

CKPTS = {0: "/c/step_00000000", 5: "/c/step_00000005", 10: "/c/step_00000010"}


def run(kind="nan", step=7, rollbacks=0, checkpoints=CKPTS, **spec):
    v = Verdict(kind=kind, step=step, rank=1, node="n1", message=f"{kind} at {step}")
    return Policy(GuardianSpec(**spec)).decide(
        v,
        iid=incident_id(JOB, kind, step),
        job_id=JOB,
        attempt=2,
        checkpoints=checkpoints,
        rollbacks=rollbacks,
        now=T0,
        data_position=42,
    )


def test_rollback_target_is_newest_at_or_before_the_anomaly():
    assert rollback_target(CKPTS, 7) == (5, "/c/step_00000005")
    assert rollback_target(CKPTS, 5) == (5, "/c/step_00000005")  # state before step 5's update
    assert rollback_target(CKPTS, 4) == (0, "/c/step_00000000")
    assert rollback_target({}, 4) is None


def test_nan_rollback_halts_then_rolls_back_in_place_past_its_data():
    d = run("nan", 7)
    assert d.action == "rollback"
    halt, rollback = d.commands
    assert halt.type == "job.halt" and rollback.type == "job.rollback"
    # a NaN in the data comes back with it: its window is skipped, as a spike's is
    assert (rollback.checkpoint, rollback.step, rollback.skip_data) == (CKPTS[5], 5, (42, 43))
    assert rollback.attempt == 2 and rollback.incident_id == d.incident.event_id
    assert [s for s, _ in outgoing(d)] == [subjects.cmd(JOB), subjects.cmd(JOB), subjects.incident(JOB)]
    assert d.incident.evidence["checkpoint_step"] == 5


def test_spike_skips_its_data_window():
    d = run("spike", 12, spike_skip_steps=3)
    assert d.commands[1].skip_data == (42, 45)
    assert run("spike", 12, spike_skip_steps=0).commands[1].skip_data is None


def test_hang_restarts_instead():
    d = run("hang", 8)
    assert [c.type for c in d.commands] == ["job.restart"]
    # a relaunch is its own action, with an id of its own: neither says "rollback"
    (restart,) = d.commands
    assert d.action == "restart" and restart.event_id == f"{d.incident.event_id}-restart"
    assert d.incident.evidence["restart"] is True and d.incident.evidence["rollback"] == 1


def test_an_in_place_rollback_stays_a_rollback():
    d = run("spike", 12)
    assert d.action == "rollback" and d.commands[1].event_id == f"{d.incident.event_id}-rollback"
    assert d.incident.evidence["restart"] is False


def test_restarts_count_toward_max_rollbacks():
    assert run("hang", 8, rollbacks=2, max_rollbacks=3).action == "restart"
    assert run("hang", 8, rollbacks=3, max_rollbacks=3).action == "fail"


def test_actions_from_the_spec():
    assert run("nan", nan="alert").commands == ()
    assert [c.type for c in run("nan", nan="halt").commands] == ["job.halt"]
    assert run("imbalance").action == "alert"  # the default
    d = run("nan", nan="fail")
    # the incident alone: the scheduler makes it FAILED and cancels the ranks itself, so no
    # CancelJob from here can race it to CANCELLED
    assert d.commands == ()
    assert [m.type for _, m in outgoing(d)] == ["incident.raised"]


def test_max_rollbacks_turns_into_fail():
    assert run("nan", rollbacks=2, max_rollbacks=3).action == "rollback"
    d = run("nan", rollbacks=3, max_rollbacks=3)
    assert d.action == "fail" and "max_rollbacks" in d.incident.message
    assert d.commands == ()


def test_no_checkpoint_halts():
    d = run("nan", 3, checkpoints={5: "/c/5"})
    assert d.action == "halt" and "no_checkpoint" in d.incident.evidence


def test_ids_are_stable():
    a, b = run("nan", 7), run("nan", 7)
    assert a.incident.event_id == b.incident.event_id
    assert [c.event_id for c in a.commands] == [c.event_id for c in b.commands]
    assert run("nan", 8).incident.event_id != a.incident.event_id


def test_deviceless_incident_goes_to_the_node_subject():
    v = Verdict(kind="gpu_health", node="n3", device=1, message="hot")
    d = Policy(GuardianSpec(gpu_health="rollback")).decide(
        v,
        iid="inc-x",
        job_id=None,
        attempt=0,
        checkpoints={},
        rollbacks=0,
        now=T0,
    )
    assert d.action == "alert" and d.commands == ()
    assert outgoing(d) == [(subjects.node_incident("n3"), d.incident)]
