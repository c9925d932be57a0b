"""Who may have sent an event: its subject's origin, checked against the job's placement.

A job's step and status subjects end with their origin (`subjects.step(job, node)`), and the NATS
server lets a worker's user publish only on its own node's (`vigil_common.credentials`). What the
server cannot know is which node runs which job: `refusal` says whether an event fits the subject it
came on and the placement of its attempt (the LaunchJob's), so a worker cannot speak for a rank on
another node, nor for the control plane. Receivers (scheduler, guardian, telemetry) pass `Origins.admit`
to their consumers (`Bus.consume(..., admit=...)`): a refused event is dead-lettered as forged, never
acted on or stored.
"""

from __future__ import annotations

import logging
import re
from collections import OrderedDict
from collections.abc import Iterable, Mapping
from pathlib import PurePosixPath
from typing import TYPE_CHECKING

from vigil.errors import MalformedMessage
from vigil.events import (
    CheckpointRefused,
    CheckpointSaved,
    GuardianSettingsChanged,
    JobStateChanged,
    LaunchJob,
    Message,
    RankPlacement,
    RestartRequested,
    RollbackCompleted,
    StepCompleted,
    decode,
)
from vigil_common import subjects

if TYPE_CHECKING:
    from vigil_common.bus import Bus

log = logging.getLogger(__name__)

# What only the control plane says (on `status(job, CONTROL)`); everything else on a job's status and
# step subjects comes from a node that runs the job.
CONTROL_EVENTS: tuple[type[Message], ...] = (JobStateChanged, GuardianSettingsChanged)

_STEP = re.compile(r"^step_[0-9]{8,}$")
STEP_VERDICTS_MAX = 65_536  # remembered per attempt (a job's ranks, and what forgers tried)
Placement = Mapping[int, str] | Iterable[RankPlacement]  # rank -> node, or the LaunchJob's list


def refusal(subject: str, event: Message, placement: Placement | None) -> str | None:
    """Why `event`, received on `subject`, cannot have come from where the subject says; None when it can.

    `placement`: the ranks of the event's attempt and their nodes (its LaunchJob's), None when no
    launch of that attempt is known. Only a job's subjects are checked; other subjects say nothing of
    their origin beyond what the server enforces.
    """
    try:
        kind = subjects.kind_of(subject)
    except ValueError:
        return f"subject {subject!r} is not in the registry"
    if subject.split(".")[1] != "job":
        return None
    job = subjects.token_at(subject)
    if event.job_id != job:
        return f"event of job {event.job_id!r} on job {job!r}'s subject"
    if kind not in ("step", "status"):
        return None
    if (why := _checkpoint_refusal(event, job)) is not None:
        return why
    origin = subjects.origin_of(subject)
    control = isinstance(event, CONTROL_EVENTS)
    if origin == subjects.CONTROL:
        return None if control else f"{event.type} does not come from the control plane"
    if control:
        return f"{event.type} comes only from the control plane, not from node {origin!r}"
    node = getattr(event, "node", None)
    if node is not None and node != origin:
        return f"event of node {node!r} on node {origin!r}'s subject"
    if placement is None:
        return f"no launch of job {job!r} attempt {event.attempt} is known"
    nodes = _nodes(placement)
    rank = getattr(event, "rank", None)
    if rank is not None:
        if rank not in nodes:
            return f"rank {rank} is not in attempt {event.attempt} of job {job!r}"
        if nodes[rank] != origin:
            return f"rank {rank} of attempt {event.attempt} runs on node {nodes[rank]!r}, not {origin!r}"
    elif origin not in nodes.values():
        return f"node {origin!r} runs no rank of attempt {event.attempt} of job {job!r}"
    return None


def _checkpoint_refusal(event: Message, job: str) -> str | None:
    """Why the checkpoint an event names cannot be one of `job`'s; None when it can. Lexical, as the
    receiver may not see the worker's disk (the worker's relay has resolved it under its checkpoint
    root): an absolute path with no `..`, `<checkpoints>/<job>/step_<step:08d>` (`vigil.manifest`)."""
    if isinstance(event, CheckpointSaved | CheckpointRefused):
        path, want = event.path, f"step_{event.step:08d}"
    elif isinstance(event, RestartRequested):
        path, want = event.checkpoint, f"step_{event.step:08d}"
    elif isinstance(event, RollbackCompleted):
        path, want = event.checkpoint, None
    else:
        return None
    p = PurePosixPath(path)
    named = p.name == want if want else _STEP.match(p.name) is not None
    if p.is_absolute() and ".." not in p.parts and p.parent.name == job and named:
        return None
    return f"checkpoint path {path!r} is not <checkpoints>/{job}/{want or 'step_<step>'}"


def _nodes(placement: Placement) -> Mapping[int, str]:
    if isinstance(placement, Mapping):
        return placement  # not copied: a step of a 1,000-rank job would copy 1,000 entries
    return {p.rank: p.node for p in placement}


class Origins:
    """`refusal` with each attempt's placement read from the job's LaunchJobs in VIGIL_JOBS (stored
    before any event of that attempt: a worker starts ranks only once it has the launch), kept for the
    last `size` attempts seen. `admit` is what a consumer passes to the bus."""

    def __init__(self, bus: Bus, size: int = 10_000) -> None:
        self.bus = bus
        self.size = size
        self._known: OrderedDict[tuple[str, int], Mapping[int, str]] = OrderedDict()
        # A step's verdict depends only on its subject, rank and node once its attempt's placement is
        # known: kept with that placement (and forgotten with it), so each rank's steps cost one check.
        self._steps: dict[tuple[str, int], dict[tuple[str, int, str], str | None]] = {}

    async def admit(self, subject: str, event: Message) -> str | None:
        """Why `event` on `subject` is refused as forged; None when it is admitted."""
        step = type(event) is StepCompleted
        if step:
            attempt = (event.job_id or "", event.attempt)
            key = (subject, event.rank, event.node)  # type: ignore[attr-defined]
            known = self._steps.get(attempt)
            if known is not None and key in known:
                self._known.move_to_end(attempt)
                return known[key]
        placement = None
        if event.job_id and _has_origin(subject) and not isinstance(event, CONTROL_EVENTS):
            placement = await self.placement(event.job_id, event.attempt)
        why = refusal(subject, event, placement)
        if step and placement is not None and attempt in self._known:
            known = self._steps.setdefault(attempt, {})
            if len(known) < STEP_VERDICTS_MAX:
                known[key] = why
        return why

    async def placement(self, job_id: str, attempt: int) -> Mapping[int, str] | None:
        """Rank -> node of the job's attempt, from its last LaunchJob of that attempt; None if none."""
        key = (job_id, attempt)
        if key in self._known:
            self._known.move_to_end(key)
            return self._known[key]
        found = None
        for launch in await self._launches(job_id):
            if launch.attempt == attempt:
                found = _nodes(launch.placement)
            self._keep(job_id, launch.attempt, _nodes(launch.placement))
        return found

    def _keep(self, job_id: str, attempt: int, nodes: Mapping[int, str]) -> None:
        self._known[(job_id, attempt)] = nodes
        self._known.move_to_end((job_id, attempt))
        self._steps.pop((job_id, attempt), None)  # judged against the placement read before
        while len(self._known) > self.size:
            gone, _ = self._known.popitem(last=False)
            self._steps.pop(gone, None)

    async def _launches(self, job_id: str) -> list[LaunchJob]:
        """Every LaunchJob stored for the job, oldest first."""
        subject, seq, found = subjects.launch(job_id), 1, []
        while (stored := await self.bus.next_stored(subjects.JOBS.name, subject, seq)) is not None:
            seq = stored.seq + 1
            try:
                launch = decode(stored.data, (LaunchJob,))
            except MalformedMessage:
                continue
            if isinstance(launch, LaunchJob) and launch.job_id == job_id:
                found.append(launch)
        return found


def _has_origin(subject: str) -> bool:
    try:
        return subjects.kind_of(subject) in ("step", "status")
    except ValueError:
        return False
