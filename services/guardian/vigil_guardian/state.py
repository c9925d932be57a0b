"""A job's control state, as the guardian saves it after every change and loads it at start.

One dataclass, `Control`, serialised by one pydantic adapter: what is listed here is what is saved.
What is not here (the detector windows, the open episodes, the steps held during a recovery) is
rebuilt after a restart by re-feeding the job's step events quietly
(`vigil_guardian.service.GuardianService.refeed`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Annotated, Any, Literal

from pydantic import PlainSerializer, TypeAdapter

from vigil.jobstates import TERMINAL_STATES, JobState
from vigil.spec import GuardianSpec

Ranks = Annotated[set[int], PlainSerializer(sorted, return_type=list[int])]


@dataclass
class Recovering:
    """A decision that stopped the job's timeline, until the ranks report back."""

    kind: Literal["rollback", "halt", "restart", "fail"]
    since: float  # epoch seconds of the decision
    to_step: int | None = None
    checkpoint: str | None = None


@dataclass
class Retuned:
    """The job's latest runtime change of its guardian settings (`GuardianSettingsChanged`): in effect
    from the first step judged after it, `from_step` (None until one is)."""

    revision: int
    changed: dict[str, Any]
    from_step: int | None = None

    def evidence(self) -> dict[str, Any]:
        """What an incident judged under it says of it."""
        return {"revision": self.revision, "from_step": self.from_step, "changed": self.changed}


@dataclass
class Control:
    """What the guardian knows of a job besides its detector windows."""

    spec: GuardianSpec = field(default_factory=GuardianSpec)
    world_size: int | None = None
    final_step: int | None = None  # the job's last step (train.steps - 1), from its launch
    checkpoint_every: int | None = None  # the spec's checkpoint.every: the steps a save comes before
    placement: dict[int, tuple[str, int]] = field(default_factory=dict)  # rank -> (node, device)
    attempt: int = 0
    attempt_started_at: float = 0.0  # the attempt's first event (its submission, for a queued job)
    launched_at: float | None = None  # the attempt's launch (LaunchJob); None until it is seen
    generation: int = 0  # rollbacks completed in this attempt
    gen_started_at: float | None = None  # when the current generation began (None: the attempt's)
    state: JobState | None = None  # the scheduler's word, when it has spoken
    checkpoints: dict[int, str] = field(default_factory=dict)  # step -> path, valid ones
    rollbacks: int = 0
    recovering: Recovering | None = None
    started: Ranks = field(default_factory=set)
    stepped: Ranks = field(default_factory=set)  # ranks that made a step in this attempt: past their start-up
    exited: Ranks = field(default_factory=set)
    running_since: float | None = None
    startups: list[float] = field(default_factory=list)  # recent attempts' start-ups: launch to all stepped
    checkpoint_bytes: int = 0  # the largest checkpoint saved: what a load may have to read
    last_rollback_completed: str | None = None
    strikes: dict[str, list[int]] = field(default_factory=dict)  # "node:device" -> steps of transient faults
    # The job runs the built-in trainer (its launch had no entrypoint): the worker vouches for its replays,
    # which strike. A user program's replays only ask the worker to check the device (`replays.diagnose`).
    vouched: bool = False
    diagnoses: dict[str, tuple[int, int]] = field(default_factory=dict)  # "node:device" -> (attempt, step)
    retuned: Retuned | None = None  # `spec` as changed at run time (None: the spec's own section)

    @property
    def terminal(self) -> bool:
        return self.state in TERMINAL_STATES

    @property
    def nodes(self) -> dict[int, str]:
        return {r: p[0] for r, p in self.placement.items()}

    @property
    def live_ranks(self) -> list[int]:
        return [r for r in range(self.world_size or 0) if r not in self.exited]

    @property
    def replay_from(self) -> float:
        """Step events created from this time on rebuild the windows after a restart."""
        return max(self.attempt_started_at, self.gen_started_at or 0.0)

    def new_attempt(self, attempt: int, at: float) -> None:
        """A relaunch: what belonged to the previous attempt is forgotten (checkpoints outlive it)."""
        self.attempt, self.attempt_started_at, self.launched_at = attempt, at, None
        self.generation, self.gen_started_at = 0, None
        self.recovering, self.running_since = None, None
        self.started, self.stepped, self.exited = set(), set(), set()
        if not self.terminal:
            self.state = None

    def snapshot(self) -> dict[str, Any]:
        return _ADAPTER.dump_python(self, mode="json")

    @classmethod
    def restore(cls, snap: dict[str, Any]) -> Control:
        return _ADAPTER.validate_python(snap)


_ADAPTER = TypeAdapter(Control)
