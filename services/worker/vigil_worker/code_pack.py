"""A job's code package on this node: fetched from the bucket by the hash its spec records
(`entrypoint.code`), checked (its bytes must hash to that name, and pass `vigil.codepack.check`), and
unpacked into the attempt's own folder, `<run dir>/attempt-<n>/code-<node>/`, where its ranks run. The
worker then gives the whole run folder to the job's user (`tenancy.give_to`): the code is the job's, and
writable.

Every attempt unpacks the hash of the spec, never the uploader's folder as it is now: a relaunch runs the
code the job was submitted with. What a rank writes there stays for the attempt; the next attempt starts
from the pack again (an earlier attempt's copy goes then). An unpacked attempt's folder is marked done
(`code-<node>.sha256` beside it), so a worker that restarts mid-launch does not unpack twice.
"""

from __future__ import annotations

import asyncio
import shutil
from pathlib import Path

from vigil import codepack
from vigil.errors import NotFound, RetryableError
from vigil.events import LaunchJob
from vigil_common import subjects
from vigil_common.bus import Bus
from vigil_common.settings import Settings
from vigil_worker.tenancy import job_dir

DONE = ".sha256"  # beside the folder: `code-<node>.sha256`


class Unavailable(RetryableError):
    """The attempt's code package cannot be had here: its bytes are not the pack the spec names, the
    bucket holds no such pack, or NATS does not answer. The attempt fails and nothing runs."""


def code_dir(settings: Settings, job_id: str, attempt: int) -> Path:
    """Where an attempt's code package is unpacked on this node (its ranks' working folder, or above it;
    named by the node: workers may share a data dir, as on one test machine)."""
    return job_dir(settings, job_id) / f"attempt-{attempt}" / f"code-{settings.node_name}"


async def unpack(bus: Bus, settings: Settings, launch: LaunchJob) -> Path | None:
    """The attempt's code folder, unpacked now or before; None for a job without a code package.
    Unavailable (nothing unpacked) when it cannot be (see the class)."""
    entry = launch.spec.entrypoint
    if entry is None or entry.code is None:
        return None
    try:
        return await _unpack(bus, settings, launch, entry.code)
    except (codepack.PackRefused, NotFound, RetryableError, OSError) as exc:
        raise Unavailable(f"code package {entry.code}: {exc}") from exc


async def _unpack(bus: Bus, settings: Settings, launch: LaunchJob, code: str) -> Path:
    dest = code_dir(settings, str(launch.job_id), launch.attempt)
    done = dest.with_name(dest.name + DONE)
    if done.is_file() and done.read_text() == code and dest.is_dir():
        return dest
    data = await bus.get_object(subjects.CODE, code)
    partial = dest.with_name(dest.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    shutil.rmtree(dest, ignore_errors=True)
    await asyncio.to_thread(codepack.unpack, data, code, partial, max_mb=settings.code_max_mb)
    partial.rename(dest)
    done.write_text(code)
    for older in job_dir(settings, str(launch.job_id)).glob(f"attempt-*/{dest.name}"):
        if older != dest:  # an earlier attempt's copy, and what it wrote there: no rank of it runs now
            shutil.rmtree(older, ignore_errors=True)
    return dest
