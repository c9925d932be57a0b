"""A share's input: the durable consumer of its jobs' events on VIGIL_JOBS (`share_input`), where its
judged sequence is saved (`cursor_key`), and where a job's events stand in the stream.

One ordered input per share. A share's job events come through one durable consumer of VIGIL_JOBS
(`share_input`, filtered on the share's stored subjects), in the order the server stored them, and are
judged in that order: a job's launch before its steps, a rank's checkpoint before its next step, a
rollback's completion before the steps after it.
"""

from __future__ import annotations

import contextlib
import logging

from vigil.errors import RetryableError
from vigil_common import credentials, subjects
from vigil_common.bus import Bus, ConsumerSpec

log = logging.getLogger(__name__)


def share_input(share: int) -> ConsumerSpec:
    """The durable consumer of one share's job events."""
    return ConsumerSpec(
        stream=subjects.JOBS,
        durable=credentials.guardian_input(share),
        filter_subject=subjects.share_events(share),
    )


INPUTS = tuple(share_input(k) for k in range(subjects.SHARES))


def job_input(job_id: str) -> ConsumerSpec:
    """The consumer that judges a job's events: its share's."""
    return share_input(subjects.share_of(job_id))


def cursor_key(share: int) -> str:
    """Where a share's judged sequence is saved (`guardian_cursor.stream`): a VIGIL_JOBS sequence. (The
    cursors of the release that read a copy, `VIGIL_SHARES/<share>`, count another stream's sequences:
    not read, see `restore`.)"""
    return f"{subjects.JOBS.name}/{subjects.check_share(share)}"


async def last_stored(bus: Bus, job_id: str) -> int | None:
    """The VIGIL_JOBS sequence of the last event stored of the job (its share's input reads that stream);
    None when there is none."""
    last = await bus.last_stored(subjects.JOBS.name, subjects.job_events(job_id))
    return last.seq if last is not None else None


async def input_idle(bus: Bus, spec: ConsumerSpec) -> bool:
    with contextlib.suppress(RetryableError):
        state = await bus.consumer_state(spec)
        return state is not None and state.idle
    return False


# --- start: restore, or a first start's bounded replay ----------------------------------------------
