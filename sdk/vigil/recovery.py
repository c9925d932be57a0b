"""What the job's commands do to a program driven through `vigil.Run` (the built-in trainer included), at a
step boundary: one receiver, one `match`.

Every rank gets the job's commands in the same order (numbered by its agent from the command stream),
and the boundary all-reduce tells every rank the highest number any of them has; `act` then runs the
same commands on every rank, in order. While halted, the ranks wait there, outside any collective, for
each next command. What a command does (`RunCommands`): a halt stops stepping; a rollback loads in place
(from the in-memory snapshot of the step every rank holds, else the chosen disk checkpoint through the
program's loader) or, with no way to load in place, stops the ranks to be relaunched from the
checkpoint; a resume goes on. Cancel and restart are the worker's and the scheduler's: they end the
processes.

`RunState` is what a `Run` and its command handling share, and all `RunCommands` sees of the run: where
it is in its steps, and the parts a command uses (its link, checkpoints, loader and snapshots). The run
owns it and hands it over; no module reads a `Run`'s private names."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol, assert_never

from vigil import collective
from vigil import events as ev
from vigil.checkpoints import Checkpoints
from vigil.exits import EXIT_PREEMPTED, EXIT_RESTART, write_exit_file
from vigil.identity import Identity
from vigil.link import Link
from vigil.protocol import RankCommand
from vigil.run_snapshots import RunSnapshots

log = logging.getLogger("vigil")

COMMAND_ARRIVAL_TIMEOUT_S = 60.0  # an agreed command must reach every rank by then


class Handler(Protocol):
    def halt(self, command: ev.HaltJob) -> None: ...

    def rollback(self, command: ev.RollbackJob, seq: int) -> None: ...

    def resume(self, command: ev.ResumeJob) -> None: ...


class Commands(Protocol):
    def command(self, seq: int, timeout_s: float) -> RankCommand: ...


@dataclass
class Inbox:
    """How far a run has acted on its commands (a `Run`'s own)."""

    handled_seq: int = 0  # commands handled (numbered from 1)
    halted: bool = False  # the ranks wait in `act` for a resume, rollback or cancel


def act(link: Commands, inbox: Inbox, agreed_seq: int, attempt: int, handler: Handler) -> None:
    """Act on commands up to `agreed_seq` in order (every rank does the same), and while halted, on each
    next command as it comes. A command for another attempt is skipped."""
    while inbox.handled_seq < agreed_seq or inbox.halted:
        seq = inbox.handled_seq + 1
        try:
            command = link.command(seq, COMMAND_ARRIVAL_TIMEOUT_S)
        except TimeoutError:
            if inbox.halted and seq > agreed_seq:
                continue  # halted: wait as long as it takes
            raise
        inbox.handled_seq = seq
        if command.attempt != attempt:
            log.info("ignoring %s of attempt %d (this is attempt %d)", command.type, command.attempt, attempt)
            continue
        match command:
            case ev.HaltJob() if not inbox.halted:
                inbox.halted = True
                handler.halt(command)
            case ev.HaltJob():
                pass  # halted already
            case ev.RollbackJob():
                handler.rollback(command, seq)
                inbox.halted = False
            case ev.ResumeJob() if inbox.halted:
                inbox.halted = False
                handler.resume(command)
            case ev.ResumeJob():
                pass  # not halted
            case _:
                assert_never(command)


class Restart(SystemExit):
    """Raised by `after_step` on every rank when the job must be relaunched from a checkpoint."""

    def __init__(self) -> None:
        super().__init__(EXIT_RESTART)


class Preempted(SystemExit):
    """Raised by `after_step` on every rank when the node is being preempted (the job is requeued)."""

    def __init__(self) -> None:
        super().__init__(EXIT_PREEMPTED)


@dataclass(frozen=True)
class Rollback:
    """One in-place rollback as this rank did it (`Run.last_rollback`); clock readings are
    `time.monotonic()`."""

    from_step: int  # the last step run before it
    to_step: int  # the step run next
    data_position: int  # the data position the checkpoint (or snapshot) recorded for `to_step`
    checkpoint: str  # the checkpoint loaded (or the one the snapshot stands for)
    from_memory: bool  # loaded from the in-memory snapshot every rank held, not from disk
    load_s: float  # the program's load alone
    total_s: float  # choosing, verifying and loading, in the ranks
    arrived: float | None  # when the command reached this rank; None without a bus
    acted: float  # when this rank began acting on it (at the first step boundary all ranks agreed on)


@dataclass
class RunState:
    """What a `Run` and its command handling share (see the module's docstring)."""

    identity: Identity
    link: Link
    checkpoints: Checkpoints
    next_step: int = 0  # the step the program runs next, as the last boundary (or a rollback) said
    generation: int = 0  # in-place rollbacks done in this attempt: which run of its steps this is
    skip_windows: list[tuple[int, int]] = field(default_factory=list)
    last_rollback: Rollback | None = None  # the newest in-place rollback of this attempt
    loader: Callable[[Path], Any] | None = None  # the program's in-place load of a checkpoint folder
    snapshots: RunSnapshots | None = None  # made by the run's first `snapshot` or `restore`
    inbox: Inbox = field(default_factory=Inbox)


class RunCommands:
    """The `Handler` of a `Run`: what each command does to its `RunState`."""

    def __init__(self, state: RunState) -> None:
        self.state = state

    def halt(self, command: ev.HaltJob) -> None:
        self.report_halt(command.reason, command.event_id)

    def report_halt(self, reason: str, command_id: str) -> None:
        """Rank 0 reports that the ranks stopped (`command_id`: the HaltJob's, or the program's own)."""
        run = self.state
        step = max(run.next_step - 1, 0)
        log.warning("vigil: halted after step %d: %s", step, reason)
        if run.identity.rank == 0:
            run.link.emit(
                ev.RanksHalted(
                    job_id=run.identity.job_id,
                    attempt=run.identity.attempt,
                    step=step,
                    command_id=command_id,
                    node=run.identity.node,
                )
            )

    def resume(self, command: ev.ResumeJob) -> None:
        log.warning("vigil: resumed at step %d", self.state.next_step)

    def rollback(self, command: ev.RollbackJob, seq: int) -> None:
        run = self.state
        acted, arrived = time.monotonic(), run.link.arrival(seq)
        t0 = time.perf_counter()
        from_step = max(run.next_step - 1, 0)
        snaps = run.snapshots
        held = snaps.held_everywhere(command.step) if snaps is not None else None  # collective
        if held is None and run.loader is None:
            self._restart(command)
        if held is not None:
            hm = held.manifest
            to_step, position, windows, source = (
                hm.step,
                hm.data_position,
                hm.skip_windows,
                command.checkpoint,
            )
        else:
            m = run.checkpoints.choose(command.checkpoint, command.step)
            to_step, position, windows, source = m.step, m.data_position, m.skip_windows, str(m.path)
        run.skip_windows = [(int(a), int(b)) for a, b in windows]
        if command.skip_data:
            run.skip_windows.append((int(command.skip_data[0]), int(command.skip_data[1])))
        t_load = time.perf_counter()
        if held is not None:
            assert snaps is not None
            snaps.load(held)
        else:
            assert run.loader is not None
            run.loader(Path(source))
        load_s = time.perf_counter() - t_load
        if snaps is not None:  # the steps after it are abandoned, in memory too
            snaps.drop_after(to_step)
        run.next_step = to_step
        run.generation += 1  # the steps from to_step on are a new run of them, beside the abandoned one
        duration = time.perf_counter() - t0
        run.last_rollback = Rollback(
            from_step, to_step, position, source, held is not None, load_s, duration, arrived, acted
        )
        where = f"{source}, from memory" if held is not None else source
        log.warning(
            "vigil: rolled back from step %d to %d (%s) in %.3fs", from_step, to_step, where, duration
        )
        if run.identity.rank == 0:
            run.link.emit(
                ev.RollbackCompleted(
                    job_id=run.identity.job_id,
                    attempt=run.identity.attempt,
                    from_step=from_step,
                    to_step=to_step,
                    checkpoint=source,
                    skip_data=command.skip_data,
                    command_id=command.event_id,
                    duration_s=duration,
                    node=run.identity.node,
                )
            )

    def _restart(self, command: ev.RollbackJob) -> None:
        """No way to load in place: stop, and be relaunched from the checkpoint."""
        run = self.state
        if run.snapshots is not None:  # the steps after the checkpoint are abandoned, in memory too
            run.snapshots.drop_after(command.step)
        if run.identity.rank == 0:
            run.link.emit(
                ev.RestartRequested(
                    job_id=run.identity.job_id,
                    attempt=run.identity.attempt,
                    checkpoint=command.checkpoint,
                    step=command.step,
                    skip_data=command.skip_data,
                    command_id=command.event_id,
                    node=run.identity.node,
                )
            )
            run.link.flush()
        collective.barrier()  # nobody exits before rank 0's request is stored
        log.warning("vigil: rollback to step %d asks for a relaunch (no in-place loader)", command.step)
        write_exit_file(EXIT_RESTART)  # declared: an abort in the interpreter's teardown does not change it
        raise Restart
