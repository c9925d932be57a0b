"""What a submitted spec must satisfy on this cluster before it is queued: the checks the gateway can make
without a worker's disk, so that a spec no worker would run is a 422 naming the field, not a FAILED job.

The worker checks again where it runs (`vigil_worker.launch.program`): it resolves `entrypoint.workdir`
with every symlink followed under its own code roots; a refusal there fails the job at once.
"""

from __future__ import annotations

from pathlib import PurePosixPath

from vigil.errors import SpecError
from vigil.spec import JobSpec, format_duration
from vigil_common.settings import Settings


def check(spec: JobSpec, settings: Settings) -> None:
    """SpecError naming the field when this cluster would refuse to run `spec`'s program, or to let it run
    as long as it asks (`scheduling.time_limit` over VIGIL_TIME_LIMIT_MAX_S)."""
    check_time_limit(spec, settings)
    entry = spec.entrypoint
    if entry is None:
        return
    if not settings.entrypoints:
        raise SpecError(
            [
                {
                    "field": "entrypoint",
                    "message": "this cluster runs the built-in trainer only (VIGIL_ENTRYPOINTS=false)",
                }
            ]
        )
    if entry.workdir is None:
        return
    workdir = PurePosixPath(entry.workdir)
    if ".." in workdir.parts:
        raise SpecError([{"field": "entrypoint.workdir", "message": f"{entry.workdir} contains '..'"}])
    roots = [PurePosixPath(r) for r in settings.allowed_code_roots]
    if workdir.is_absolute() and not any(workdir == r or workdir.is_relative_to(r) for r in roots):
        names = ", ".join(str(r) for r in roots)
        raise SpecError(
            [
                {
                    "field": "entrypoint.workdir",
                    "message": f"{entry.workdir} is outside the code roots ({names}); see VIGIL_CODE_ROOTS",
                }
            ]
        )


def check_time_limit(spec: JobSpec, settings: Settings) -> None:
    """SpecError naming `scheduling.time_limit` when it exceeds VIGIL_TIME_LIMIT_MAX_S."""
    limit, most = spec.scheduling.time_limit, settings.time_limit_max_s
    if limit is not None and most is not None and limit > most:
        message = (
            f"{format_duration(limit)} exceeds this cluster's maximum of {format_duration(most)} "
            "(VIGIL_TIME_LIMIT_MAX_S): ask for less, and resume a longer run from its checkpoint"
        )
        raise SpecError([{"field": "scheduling.time_limit", "message": message}])
