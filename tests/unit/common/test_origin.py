"""origin.refusal: an event counts only from the node its attempt's launch placed it on, and a job's state
changes only from the control plane; Origins reads that placement from the stored launches."""

from __future__ import annotations

import uuid
from types import SimpleNamespace
from typing import Any

import nats.errors
import nats.js.errors
import pytest

from tests.unit.common.samples import SAMPLES
from vigil.errors import RetryableError
from vigil.events import (
    CheckpointSaved,
    JobStateChanged,
    LaunchJob,
    Message,
    NodeHeartbeat,
    RankExited,
    RankPlacement,
    RankStarted,
    RestartRequested,
    RollbackCompleted,
    StepCompleted,
)
from vigil_common import subjects
from vigil_common.bus import Bus
from vigil_common.origin import Origins, refusal

JOB = "j-a"
ON_N2 = {0: "n2", 1: "n2"}  # attempt 1 of JOB: both ranks on n2


def event(kind: type[Message], **update: Any) -> Message:
    return SAMPLES[kind].model_copy(
        update={"event_id": uuid.uuid4().hex, "job_id": JOB, "attempt": 1, **update}
    )


def nan_step(node: str, rank: int = 0) -> Message:
    return event(StepCompleted, node=node, rank=rank, loss=float("nan"), local_finite=False)


def clean_exit(node: str, rank: int = 0) -> Message:
    return event(RankExited, node=node, rank=rank, exit_code=0, failure="ok")


def test_a_rank_counts_from_the_node_its_launch_placed_it_on() -> None:
    assert refusal(subjects.step(JOB, "n2"), nan_step("n2"), ON_N2) is None
    assert refusal(subjects.status(JOB, "n2"), clean_exit("n2", rank=1), ON_N2) is None
    assert refusal(subjects.status(JOB, "n2"), event(RankStarted, node="n2", rank=0), ON_N2) is None


@pytest.mark.parametrize(
    ("subject", "forged", "why"),
    [
        # a worker on n1 speaks for ranks on n2, on its own node's subjects (all the server lets it use)
        (subjects.step(JOB, "n1"), nan_step("n1"), "runs on node 'n2', not 'n1'"),
        (subjects.status(JOB, "n1"), clean_exit("n1"), "runs on node 'n2', not 'n1'"),
        # ... naming n2 in the event, on its own subject
        (subjects.step(JOB, "n1"), nan_step("n2"), "event of node 'n2' on node 'n1'"),
        (subjects.status(JOB, "n1"), clean_exit("n2"), "event of node 'n2' on node 'n1'"),
        # ... a rank the attempt does not have
        (subjects.status(JOB, "n2"), clean_exit("n2", rank=7), "rank 7 is not in attempt 1"),
        # ... a checkpoint of a job it runs no rank of
        (
            subjects.status(JOB, "n1"),
            event(CheckpointSaved, path=f"/c/{JOB}/step_00000020"),
            "node 'n1' runs no rank of attempt 1",
        ),
        # ... another job's event on this job's subject
        (subjects.step("j-b", "n2"), nan_step("n2"), "event of job 'j-a' on job 'j-b'"),
        # ... a state change, which only the control plane makes
        (
            subjects.status(JOB, "n2"),
            event(JobStateChanged, from_state="RUNNING", to_state="SUCCEEDED"),
            "comes only from the control plane",
        ),
        # ... and the control plane's subject carries nothing else
        (subjects.status(JOB, subjects.CONTROL), clean_exit("n2"), "does not come from the control plane"),
    ],
)
def test_a_forged_event_is_refused_with_the_reason(subject: str, forged: Message, why: str) -> None:
    reason = refusal(subject, forged, ON_N2)
    assert reason is not None and why in reason, reason


def test_a_state_change_counts_from_the_control_plane_without_a_placement() -> None:
    changed = event(JobStateChanged, from_state="RUNNING", to_state="SUCCEEDED")
    assert refusal(subjects.status(JOB, subjects.CONTROL), changed, None) is None


def test_an_event_of_an_attempt_never_launched_is_refused() -> None:
    reason = refusal(subjects.step(JOB, "n2"), nan_step("n2"), None)
    assert reason is not None and "no launch of job 'j-a' attempt 1" in reason


def test_a_checkpoint_counts_from_a_node_that_runs_a_rank_of_the_attempt() -> None:
    saved = event(CheckpointSaved, path=f"/data/checkpoints/{JOB}/step_00000040", step=40)
    assert refusal(subjects.status(JOB, "n2"), saved, ON_N2) is None


@pytest.mark.parametrize(
    "path",
    [
        "/data/checkpoints/j-b/step_00000040",  # another job's
        "/etc/passwd",
        f"/data/checkpoints/{JOB}/step_00000041",  # not the step it reports
        f"/data/checkpoints/{JOB}/../j-b/step_00000040",
        f"checkpoints/{JOB}/step_00000040",  # relative
        f"/data/checkpoints/{JOB}/step_00000040/../../j-b/step_00000040",
    ],
)
def test_a_checkpoint_outside_the_jobs_own_folder_is_refused(path: str) -> None:
    """The probe stored and listed a forged `CheckpointSaved` for any path."""
    forgeries = [
        event(CheckpointSaved, path=path, step=40),
        event(RestartRequested, checkpoint=path, step=40),
    ]
    if not path.endswith("41"):  # a rollback's checkpoint may be of any step
        forgeries.append(event(RollbackCompleted, checkpoint=path))
    for forged in forgeries:
        reason = refusal(subjects.status(JOB, "n2"), forged, ON_N2)
        assert reason is not None and "is not <checkpoints>/j-a/" in reason, (forged.type, reason)


def test_the_placement_may_be_the_launchs_list() -> None:
    placement = [RankPlacement(rank=0, node="n1", device=0, local_rank=0)]
    assert refusal(subjects.step(JOB, "n1"), nan_step("n1"), placement) is None
    assert refusal(subjects.step(JOB, "n2"), nan_step("n2"), placement) is not None


def test_subjects_without_an_origin_are_checked_for_their_job_only() -> None:
    beat = SAMPLES[NodeHeartbeat]
    assert refusal(subjects.heartbeat("n1"), beat, None) is None  # the server checks the node
    launch = event(LaunchJob)
    assert refusal(subjects.launch(JOB), launch, None) is None
    assert refusal(subjects.launch("j-b"), launch, None) is not None
    assert "not in the registry" in (refusal("vigil.job.j-a.other", launch, None) or "")


def stored_launch(attempt: int, nodes: dict[int, str]) -> LaunchJob:
    placement = [RankPlacement(rank=r, node=n, device=0, local_rank=r) for r, n in nodes.items()]
    launch = event(LaunchJob, attempt=attempt, placement=placement)
    assert isinstance(launch, LaunchJob)
    return launch


class FakeJetStream:
    """`get_msg(stream, seq, subject, next=True)` over a list of published (subject, message), stored as
    the server stores them (`subjects.stored`)."""

    def __init__(self, stored: list[tuple[str, Message]]) -> None:
        self.stored = [(subjects.stored(subject), msg) for subject, msg in stored]
        self.reads = 0
        self.fail: Exception | None = None

    async def get_msg(self, stream: str, *, seq: int, subject: str, next: bool) -> SimpleNamespace:
        assert stream == subjects.JOBS.name and next
        self.reads += 1
        if self.fail is not None:
            raise self.fail
        for at, (stored_on, msg) in enumerate(self.stored, start=1):
            if at >= seq and stored_on == subject:
                return SimpleNamespace(seq=at, subject=stored_on, data=msg.to_bytes(), headers=None)
        raise nats.js.errors.NotFoundError


def reading(js: FakeJetStream) -> Bus:
    """A bus whose stream reads are `js`'s."""
    bus = object.__new__(Bus)
    bus.js = js  # type: ignore[assignment]
    bus.legacy_jobs = False  # a stream made with its transform
    return bus


async def test_origins_reads_each_attempts_placement_from_its_launch_once() -> None:
    js = FakeJetStream(
        [
            (subjects.launch(JOB), stored_launch(1, ON_N2)),
            (
                subjects.launch("j-other"),
                stored_launch(1, {0: "n1"}).model_copy(update={"job_id": "j-other"}),
            ),
            (subjects.launch(JOB), stored_launch(2, {0: "n1", 1: "n2"})),
        ]
    )
    origins = Origins(reading(js))
    assert await origins.admit(subjects.step(JOB, "n2"), nan_step("n2")) is None
    refused = await origins.admit(subjects.step(JOB, "n1"), nan_step("n1"))
    assert refused is not None and "runs on node 'n2'" in refused
    reads = js.reads
    # attempt 2 was kept from the same read; attempt 1 again is cached
    assert (
        await origins.admit(subjects.step(JOB, "n1"), nan_step("n1").model_copy(update={"attempt": 2}))
        is None
    )
    assert await origins.admit(subjects.status(JOB, "n2"), clean_exit("n2")) is None
    assert js.reads == reads
    unknown = await origins.admit(subjects.step(JOB, "n2"), nan_step("n2").model_copy(update={"attempt": 3}))
    assert unknown is not None and "no launch" in unknown


async def test_origins_reads_no_launch_for_a_control_plane_event() -> None:
    js = FakeJetStream([])
    origins = Origins(reading(js))
    changed = event(JobStateChanged, from_state="RUNNING", to_state="FAILED")
    assert await origins.admit(subjects.status(JOB, subjects.CONTROL), changed) is None
    assert js.reads == 0


async def test_origins_that_cannot_read_the_launches_asks_for_a_retry() -> None:
    js = FakeJetStream([])
    js.fail = nats.errors.TimeoutError()
    origins = Origins(reading(js))
    with pytest.raises(RetryableError, match=r"reading vigil\.job\.j-a\.launch from VIGIL_JOBS"):
        await origins.admit(subjects.step(JOB, "n2"), nan_step("n2"))


async def test_a_steps_verdict_is_kept_with_its_attempts_placement_and_forgotten_with_it() -> None:
    other = stored_launch(1, {0: "n1"}).model_copy(update={"job_id": "j-b"})
    js = FakeJetStream([(subjects.launch(JOB), stored_launch(1, ON_N2)), (subjects.launch("j-b"), other)])
    origins = Origins(reading(js), size=1)
    for _ in range(3):  # the same verdicts every time, from one read
        assert await origins.admit(subjects.step(JOB, "n2"), nan_step("n2")) is None
        refused = await origins.admit(subjects.step(JOB, "n1"), nan_step("n1"))
        assert refused is not None and "runs on node 'n2'" in refused
        absent = await origins.admit(subjects.step(JOB, "n2"), nan_step("n2", rank=5))
        assert absent is not None and "rank 5 is not in attempt 1" in absent
    reads = js.reads
    # another attempt takes the only place (size 1): this one's steps are checked against a new read
    b_step = nan_step("n1").model_copy(update={"job_id": "j-b"})
    assert await origins.admit(subjects.step("j-b", "n1"), b_step) is None
    assert await origins.admit(subjects.step(JOB, "n2"), nan_step("n2")) is None
    assert js.reads > reads + 1
    refused = await origins.admit(subjects.step(JOB, "n1"), nan_step("n1"))
    assert refused is not None and "runs on node 'n2'" in refused
