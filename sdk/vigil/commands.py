"""Acting on the job's commands at a step boundary: one receiver, one `match`.

Every rank gets the job's commands in the same order (numbered by its agent from the command stream),
and the boundary all-reduce tells every rank the highest number any of them has; `act` then runs the
same commands on every rank, in order. While halted, the ranks wait here, outside any collective, for
each next command. What a command does to the program (stop stepping, load a checkpoint) is the
`Handler`'s: the built-in trainer's loads DeepSpeed checkpoints, a user program's calls the loader it
registered (`vigil.Run.on_rollback`).
"""

from __future__ import annotations

import logging
from typing import Protocol, assert_never

from vigil import events as ev
from vigil.protocol import RankCommand

log = logging.getLogger("vigil.rank")

COMMAND_ARRIVAL_TIMEOUT_S = 60.0  # an agreed command must reach every rank by then


class Handler(Protocol):
    def halt(self, command: ev.HaltJob) -> None: ...

    def rollback(self, command: ev.RollbackJob, seq: int) -> None: ...

    def resume(self, command: ev.ResumeJob) -> None: ...


class Commands(Protocol):
    def command(self, seq: int, timeout_s: float) -> RankCommand: ...


class Inbox(Protocol):
    """Where the program keeps how far it has acted (the built-in trainer's TrainState, a Run)."""

    handled_seq: int
    halted: bool


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
