"""An incident the bus refuses for good, cut down to one it takes.

The guardian publishes a decision's messages in order, and judges nothing after a decision until it is
out. A message the server will never take (over its stream's `max_msg_size` or the server's
`max_payload`) must therefore not be retried: its incident goes out `truncated` (the message and
evidence cut, marked, with the size they had), and a message that still does not fit is dead-lettered.
Pure: no I/O.
"""

from __future__ import annotations

from typing import Any

from vigil.events import IncidentRaised

MAX_MESSAGE_CHARS = 2000
MAX_ITEMS = 16  # of a list or dict in the evidence
MAX_TEXT_CHARS = 500  # of a string in the evidence
MAX_TRUNCATED_BYTES = 16 * 1024  # past this even cut, only the evidence's keys are kept


def truncated(incident: IncidentRaised) -> IncidentRaised:
    """`incident` with its message and evidence cut to fit, its evidence marked `truncated` with the size
    the incident had (`original_bytes`)."""
    original = len(incident.to_bytes())
    message = incident.message
    if len(message) > MAX_MESSAGE_CHARS:
        message = message[:MAX_MESSAGE_CHARS] + f"... ({len(message):,} characters, truncated)"
    marks = {"truncated": True, "original_bytes": original}
    evidence = _cut(incident.evidence)
    cut = incident.model_copy(update={"message": message, "evidence": {**evidence, **marks}})
    if len(cut.to_bytes()) <= MAX_TRUNCATED_BYTES:
        return cut
    keys = [str(k)[:100] for k in list(incident.evidence)[:MAX_ITEMS]]
    return cut.model_copy(update={"evidence": {**marks, "keys": keys}})


def _cut(value: Any, depth: int = 0) -> Any:
    if depth > 4:
        return "..."
    if isinstance(value, str):
        return value if len(value) <= MAX_TEXT_CHARS else value[:MAX_TEXT_CHARS] + "..."
    if isinstance(value, list | tuple):
        head = [_cut(v, depth + 1) for v in value[:MAX_ITEMS]]
        return [*head, f"... {len(value) - MAX_ITEMS} more"] if len(value) > MAX_ITEMS else head
    if isinstance(value, dict):
        items = list(value.items())
        head = {str(k)[:100]: _cut(v, depth + 1) for k, v in items[:MAX_ITEMS]}
        if len(items) > MAX_ITEMS:
            head["..."] = f"{len(items) - MAX_ITEMS} more"
        return head
    return value
