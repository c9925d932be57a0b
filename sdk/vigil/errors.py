"""One exception hierarchy for all of Vigil.

Errors are classified only at the edges: the bus (retry or terminate a message) and
the HTTP gateway (status codes). Messages name the field or value and, where possible,
the fix.
"""

from __future__ import annotations


class VigilError(Exception):
    """The root of every error Vigil raises on purpose."""


def first_error(
    exc: BaseException, kinds: tuple[type[BaseException], ...] = (VigilError,)
) -> BaseException | None:
    """The first of `kinds` (a VigilError) in `exc`, looking inside exception groups (a service's
    TaskGroup wraps its failures in them); None when there is none: then `exc` is a bug."""
    if isinstance(exc, kinds):
        return exc
    if isinstance(exc, BaseExceptionGroup):
        for inner in exc.exceptions:
            if (found := first_error(inner, kinds)) is not None:
                return found
    return None


class RetryableError(VigilError):
    """A transient failure: the same input may succeed later (a lost connection, a busy database)."""


class PermanentError(VigilError):
    """The input itself is wrong: retrying cannot help."""


class PublishRefused(PermanentError):
    """The bus refused a message for good (larger than the server or its stream takes, a bad subject, a
    full stream that discards new messages): publishing the same message again cannot help."""


class RejectedEvents(PermanentError):
    """Some events of a batch cannot be stored, ever (a row the database refuses); the rest of the batch
    is stored. `reasons` maps each rejected event's stream sequence to why: the bus dead-letters those
    and acknowledges the others."""

    def __init__(self, reasons: dict[int, str]) -> None:
        self.reasons = reasons
        super().__init__(f"{len(reasons)} events rejected: " + "; ".join(list(reasons.values())[:3]))


class ConfigError(PermanentError):
    """A setting is missing or invalid; the message names the variable."""


class SpecError(PermanentError):
    """A job spec is invalid. `errors` holds `{"field", "message"}` entries, one per bad field."""

    def __init__(self, errors: list[dict[str, str]]) -> None:
        self.errors = errors
        super().__init__("; ".join(f"{e['field']}: {e['message']}" for e in errors))


class MalformedMessage(PermanentError):
    """A bus message that cannot be decoded into the event its subject carries."""


class NotFound(PermanentError):
    """The named object does not exist."""


class Conflict(PermanentError):
    """The request contradicts the object's state (cancel a finished job, say)."""


class CheckpointError(PermanentError):
    """A checkpoint is missing, corrupt, or outside the checkpoint root."""
