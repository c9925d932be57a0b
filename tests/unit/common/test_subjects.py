import re
from pathlib import Path

import pytest

from vigil import events as ev
from vigil_common import subjects

ROOT = Path(__file__).resolve().parents[3]
SOURCE_DIRS = ["libs", "services", "trainer", "cli", "bench"]


def test_builders_validate_tokens():
    assert subjects.step("j-1", "n1") == "vigil.job.j-1.step.n1"
    assert subjects.status("j-1", "n1") == "vigil.job.j-1.status.n1"
    assert subjects.status("j-1", subjects.CONTROL) == "vigil.job.j-1.status._control"
    for bad in ["a.b", "*", ">", "a b", "", "x" * 65]:
        with pytest.raises(ValueError, match="subject token"):
            subjects.step(bad, "n1")
        with pytest.raises(ValueError, match="subject token"):
            subjects.step("j-1", bad)


def test_no_node_name_can_be_the_control_origin():
    """A node's worker may publish on its node's subjects: a node named like the control plane's
    origin would publish the scheduler's status events."""
    for build in (subjects.heartbeat, subjects.gpu, subjects.node_steps, subjects.node_status):
        with pytest.raises(ValueError, match="may not start with '_'"):
            build(subjects.CONTROL)
    with pytest.raises(ValueError, match="may not start with '_'"):
        subjects.step("j1", subjects.CONTROL)
    with pytest.raises(ValueError, match="may not start with '_'"):
        subjects.status("j1", "_other")


def test_kinds_origins_and_tokens_of_subjects():
    assert subjects.kind_of(subjects.step("j1", "n1")) == "step"
    assert subjects.kind_of(subjects.status("j1", subjects.CONTROL)) == "status"
    assert subjects.kind_of(subjects.launch("j1")) == "launch"
    assert subjects.origin_of(subjects.step("j1", "n1")) == "n1"
    assert subjects.origin_of(subjects.status("j1", subjects.CONTROL)) == subjects.CONTROL
    assert subjects.token_at(subjects.status("j1", "n1")) == "j1"
    for unknown in ("vigil.job.j1.step", "vigil.job.j1.status", "vigil.job.j1.launch.n1"):
        with pytest.raises(ValueError, match="registry"):
            subjects.kind_of(unknown)
    with pytest.raises(ValueError, match="no origin"):
        subjects.origin_of(subjects.cmd("j1"))
    assert subjects.matches(subjects.node_steps("n1"), subjects.step("j1", "n1"))
    assert not subjects.matches(subjects.node_steps("n1"), subjects.step("j1", "n2"))
    assert subjects.matches(subjects.job_status("j1"), subjects.status("j1", subjects.CONTROL))
    assert not subjects.matches(subjects.job_status("j1"), subjects.status("j2", "n1"))


def test_the_control_planes_status_is_apart_from_every_nodes():
    """The scheduler's permissions and the guardian's scan of ended jobs name `CONTROL_STATUS`."""
    assert subjects.matches(subjects.CONTROL_STATUS, subjects.status("j1", subjects.CONTROL))
    assert not subjects.matches(subjects.CONTROL_STATUS, subjects.status("j1", "n1"))
    assert not subjects.matches(subjects.node_status("n1"), subjects.status("j1", subjects.CONTROL))
    assert subjects.matches(subjects.ALL_STATUS, subjects.status("j1", subjects.CONTROL))
    assert subjects.matches(subjects.ALL_JOB_EVENTS, subjects.step("j1", "n1"))
    assert not subjects.matches(subjects.ALL_JOB_EVENTS, subjects.incident("j1"))


@pytest.mark.parametrize(
    ("subject", "stream"),
    [
        (subjects.heartbeat("n1"), "VIGIL_NODES"),
        (subjects.gpu("n1"), "VIGIL_NODES"),
        (subjects.launch("j1"), "VIGIL_JOBS"),
        (subjects.status("j1", "n1"), "VIGIL_JOBS"),
        (subjects.status("j1", subjects.CONTROL), "VIGIL_JOBS"),
        (subjects.step("j1", "n1"), "VIGIL_JOBS"),
        (subjects.cmd("j1"), "VIGIL_COMMANDS"),
        (subjects.incident("j1"), "VIGIL_INCIDENTS"),
        (subjects.dead_letter("VIGIL_STEPS"), "VIGIL_DEAD_LETTERS"),
    ],
)
def test_every_subject_is_stored_by_exactly_one_stream(subject, stream):
    owners = [s.name for s in subjects.STREAMS for p in s.subjects if subjects._matches(p, subject)]
    assert owners == [stream]
    assert subjects.stream_for(subject).name == stream


def test_every_event_is_carried_by_some_subject():
    carried = {cls for classes in subjects.CARRIES.values() for cls in classes}
    assert carried == set(ev.EVENT_CLASSES)


def test_command_stream_never_evicts_silently():
    assert subjects.COMMANDS.discard_new
    for spec in subjects.STREAMS:
        assert spec.max_bytes > 0 and spec.max_age_s > 0 and spec.duplicate_window_s > 0


def test_no_subject_is_spelled_outside_the_registry():
    literal = re.compile(r"""["'`]vigil\.(node|job|incident|deadletter|probe)\b""")
    offenders = []
    for folder in SOURCE_DIRS:
        for path in (ROOT / folder).rglob("*.py"):
            if path.name == "subjects.py" and path.parent.name == "vigil_common":
                continue
            for n, line in enumerate(path.read_text().splitlines(), 1):
                if literal.search(line):
                    offenders.append(f"{path.relative_to(ROOT)}:{n}: {line.strip()}")
    assert not offenders, "use vigil_common.subjects builders:\n" + "\n".join(offenders)


def test_vigil_jobs_stores_each_event_under_its_share():
    share = subjects.share_of("j1")
    assert subjects.stored(subjects.step("j1", "n1")) == f"vigil.share.{share}.job.j1.step.n1"
    assert subjects.stored(subjects.launch("j1")) == f"vigil.share.{share}.job.j1.launch"
    assert subjects.stored(subjects.job_events("j1")) == f"vigil.share.{share}.job.j1.>"
    assert subjects.stored(subjects.ALL_STATUS) == "vigil.share.*.job.*.status.*"
    assert subjects.stored(subjects.ALL_JOB_EVENTS) == "vigil.share.*.job.*.>"
    for other in (subjects.cmd("j1"), subjects.ALL_CMDS, subjects.gpu("n1"), subjects.incident("j1")):
        assert subjects.stored(other) == other  # not VIGIL_JOBS's
    for subject in (subjects.step("j1", "n1"), subjects.status("j1", subjects.CONTROL), subjects.ALL_STEPS):
        assert subjects.published(subjects.stored(subject)) == subject
        assert subjects.stored(subjects.stored(subject)) == subjects.stored(subject)
    assert subjects.published(subjects.share_events(3)) == subjects.ALL_JOB_EVENTS
    stored_step = subjects.stored(subjects.step("j1", "n1"))
    assert subjects.kind_of(stored_step) == "step"
    assert subjects.token_at(stored_step) == "j1"
    assert subjects.origin_of(stored_step) == "n1"
    assert subjects.stream_for(stored_step) is subjects.JOBS
    # what the server's transform writes is what `stored` says (the partition is checked against a
    # server in tests/integration/common/test_shares.py)
    src, dest = subjects.JOBS.transform or ("", "")
    assert src == "vigil.job.*.>" and dest.startswith("vigil.share.{{partition(16,1)}}.job.{{wildcard(1)}}")
    assert not any(spec.name in subjects.RETIRED_STREAMS for spec in subjects.STREAMS)


def test_readers_read_both_forms_while_the_stream_may_hold_the_old_one():
    share = subjects.share_of("j1")
    assert subjects.reads(subjects.ALL_STEPS, legacy=False) == ("vigil.share.*.job.*.step.*",)
    assert subjects.reads(subjects.ALL_STEPS, legacy=True) == (
        "vigil.share.*.job.*.step.*",
        subjects.ALL_STEPS,
    )
    assert subjects.reads(subjects.job_steps("j1"), legacy=True) == (
        f"vigil.share.{share}.job.j1.step.*",
        subjects.job_steps("j1"),
    )
    assert subjects.reads(subjects.share_events(share), legacy=True) == (
        subjects.share_events(share),
        subjects.ALL_JOB_EVENTS,
    )
    assert subjects.reads(subjects.ALL_CMDS, legacy=True) == (subjects.ALL_CMDS,)  # not VIGIL_JOBS's
    # a share's reader holds its jobs' events in either form, never another share's
    old, new = subjects.step("j1", "n1"), subjects.stored(subjects.step("j1", "n1"))
    for subject in (old, new):
        assert subjects.holds(subjects.share_events(share), subject)
        assert not subjects.holds(subjects.share_events((share + 1) % subjects.SHARES), subject)
        assert subjects.holds(subjects.ALL_STEPS, subject)
        assert subjects.holds(subjects.job_steps("j1"), subject)
        assert not subjects.holds(subjects.job_steps("j2"), subject)
        assert not subjects.holds(subjects.ALL_STATUS, subject)
