"""A preemption notice that comes while a rank still starts is kept (`listen_early`) and taken over, once,
by the notice the program installs later; without it, SIGUSR1's default action would end the process."""

from __future__ import annotations

import os
import signal

from vigil import preemption
from vigil.preemption import SIGNAL, PreemptionNotice


def test_a_notice_during_the_start_is_kept_and_taken_over_once() -> None:
    before = signal.getsignal(SIGNAL)
    try:
        preemption.listen_early()
        os.kill(os.getpid(), SIGNAL)  # delivered to the main thread before the next bytecode
        first = PreemptionNotice().install()
        assert first.requested
        second = PreemptionNotice().install()  # a later attempt in the same process starts clean
        assert not second.requested
        os.kill(os.getpid(), SIGNAL)
        assert second.requested and not PreemptionNotice().requested
    finally:
        signal.signal(SIGNAL, before)


def test_without_an_early_notice_nothing_is_requested() -> None:
    before = signal.getsignal(SIGNAL)
    try:
        preemption.listen_early()
        assert not PreemptionNotice().install().requested
    finally:
        signal.signal(SIGNAL, before)
