"""The HTTP shape of a code package (`POST /api/v1/code`): what the gateway answers for an upload. One
definition for the gateway and `vigil.Client`, as in `vigil.api`."""

from __future__ import annotations

from vigil.api import Out


class CodePackOut(Out):
    """A code package the gateway keeps: a spec names it by `sha256` in `entrypoint.code`."""

    sha256: str
    bytes: int  # the pack's (gzipped tar)
    entries: int  # files, folders and links in it
    stored: bool  # False: the same bytes were kept already
