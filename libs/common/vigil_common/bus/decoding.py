"""From a received or stored message to an event: only the types its subject carries (the registry,
`subjects.CARRIES`), only from the stream it belongs to, and only when its origin is admitted. The step
events, most of the volume, are decoded by msgspec first (`FastDecoder`, from the struct
`vigil_common.msgspec_events` derives from the model); what msgspec refuses goes to pydantic."""

from __future__ import annotations

import functools
import logging
from collections.abc import Awaitable, Callable, Sequence
from datetime import datetime

import msgspec
from nats.aio.msg import Msg
from pydantic import BaseModel

from vigil.errors import MalformedMessage
from vigil.events import Message, StepCompleted, decode
from vigil_common import subjects
from vigil_common.bus.streams import Stored
from vigil_common.msgspec_events import built, derive

log = logging.getLogger(__name__)

# The events decoded by msgspec first (`FastDecoder`): a step per rank per step is most of
# what telemetry stores and the guardian judges. What msgspec refuses goes to pydantic's `decode`.
FAST_DECODED: tuple[type[Message], ...] = (StepCompleted,)

# Why an event on a subject is refused as forged, None when it is admitted (`vigil_common.origin`).
Admit = Callable[[str, Message], Awaitable[str | None]]


class FastDecoder:
    """Decode one event class with msgspec, by the struct derived from its model (`msgspec_events`)."""

    def __init__(self, model: type[BaseModel]) -> None:
        self.model = model
        self.struct, _, self._datetimes = derive(model, nonfinite=False)
        self._decoder = msgspec.json.Decoder(self.struct)
        nonfinite, self._floats, _ = derive(model, nonfinite=True)
        self._nonfinite = msgspec.json.Decoder(nonfinite)
        self._asdict = msgspec.structs.asdict

    def decode(self, data: bytes) -> BaseModel | None:
        """The event `data` holds, or None when msgspec refuses it (pydantic then decides, and says why)."""
        nonfinite = b'"NaN"' in data or b'inity"' in data
        try:
            values = self._asdict((self._nonfinite if nonfinite else self._decoder).decode(data))
        except msgspec.MsgspecError:
            return None
        if nonfinite:
            for name in self._floats:
                if type(values[name]) is str:
                    values[name] = float(values[name])  # "NaN", "Infinity" or "-Infinity"
        for name in self._datetimes:
            if type(at := values[name]) is str:
                try:
                    values[name] = _fromisoformat(at)
                except ValueError:  # a date that does not exist (month 13, hour 24): pydantic says so
                    return None
        return built(self.model, values)


_fromisoformat = datetime.fromisoformat


@functools.cache
def fast_decoder(model: type[BaseModel]) -> FastDecoder:
    """The decoder of `model` (built once)."""
    return FastDecoder(model)


@functools.lru_cache(maxsize=65_536)
def _carried(subject: str) -> tuple[tuple[type[Message], ...], FastDecoder | None] | None:
    """What `subject` carries and its fast decoder; None when it is not in the registry. Parsed once per
    subject: a job's steps come on one subject per node."""
    try:
        carries = subjects.CARRIES[subjects.kind_of(subject)]
    except (KeyError, ValueError):
        return None
    return carries, fast_decoder(carries[0]) if carries[0] in FAST_DECODED else None


def decode_message(msg: Msg | Stored) -> Message:
    """The event `msg` carries, if its subject is in the registry and carries that type; else
    MalformedMessage."""
    if (carried := _carried(msg.subject)) is None:
        raise MalformedMessage(f"subject {msg.subject!r} is not in the registry")
    carries, fast = carried
    if fast is not None and (event := fast.decode(msg.data)) is not None:
        return event  # type: ignore[return-value]
    return decode(msg.data, carries)


def decode_stored(filter_subjects: Sequence[str], msg: Stored) -> Message:
    """Decode a stored message only if it was read from the stream that stores one of
    `filter_subjects`, on a subject they match (in either form: `subjects.holds`)."""
    wanted = [f for f in filter_subjects if subjects.holds(f, msg.subject)]
    if not wanted or msg.stream != subjects.stream_for(wanted[0]).name:
        raise MalformedMessage(
            f"{msg.subject!r} was not read from the stream of {', '.join(filter_subjects)} "
            f"(stream {msg.stream!r}): ignored"
        )
    return decode_message(msg)


async def admitted(msg: Msg | Stored, admit: Admit | None) -> Message:
    """The decoded message, if `admit` (when given) admits it; MalformedMessage if not."""
    event = decode_message(msg)
    if admit is not None and (why := await admit(subjects.published(msg.subject), event)) is not None:
        log.warning("refused a forged %s on %s: %s", event.type, msg.subject, why)
        raise MalformedMessage(f"refused as forged: {why}")
    return event
