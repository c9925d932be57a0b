"""A per-attempt writable working folder for a job whose code is already on the node (a code root,
`VIGIL_CODE_ROOTS`): its ranks run in `<run dir>/attempt-<n>/work-<node>`, a view of their
`entrypoint.workdir` in which they may write, while the code root itself is never written.

Where the kernel has overlayfs and the worker is root, the view is an overlay mount: the code root's folder
is its lower layer (read only), an upper layer of the attempt's own (`<data dir>/worker/overlays/`, where
no job's user reaches) takes every write, and no file is copied (its folders are given to the job's user:
it creates files anywhere in the view; the code's own files stay as their owner made them). Elsewhere (no
overlayfs, no root, a path overlayfs cannot name) it is a copy of the folder, refused past
VIGIL_WORKDIR_COPY_MAX_MB. Either way the worker gives the attempt's folder to the job's user
(`tenancy.give_to`), the mount's root included.

The mount goes when the attempt has no rank left here (`release`), and an earlier attempt's view and its
writes go when the next one is made: what a program writes in its working folder lasts for its attempt.
(A job with a code package runs in its attempt's own unpacked copy instead: `code_pack`.)
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import logging
import os
import shutil
import stat
from pathlib import Path

from vigil.errors import SpecError
from vigil.events import LaunchJob
from vigil_common.settings import Settings
from vigil_worker.launch import RankLaunch
from vigil_worker.tenancy import JobUser, job_dir

log = logging.getLogger("vigil.worker")

MIB = 1024 * 1024
MNT_DETACH = 2
_UNSAFE = (",", ":", "\\", "\n")  # what overlayfs's options cannot name in a path


def view_dir(settings: Settings, job_id: str, attempt: int) -> Path:
    """This node's view (named by the node: workers may share a data dir, as on one test machine)."""
    return job_dir(settings, job_id) / f"attempt-{attempt}" / f"work-{settings.node_name}"


def _layers(settings: Settings, job_id: str, attempt: int) -> Path:
    return settings.data_dir.resolve() / "worker" / "overlays" / f"{job_id}.{attempt}.{settings.node_name}"


def make(settings: Settings, job_id: str, attempt: int, source: Path, user: JobUser | None) -> Path:
    """The attempt's writable view of `source` (a folder under a code root), made now; SpecError naming
    VIGIL_WORKDIR_COPY_MAX_MB when it must be copied and is larger."""
    for older in job_dir(settings, job_id).glob(f"attempt-*/work-{settings.node_name}"):
        number = older.parent.name.removeprefix("attempt-")
        if number.isdigit() and int(number) != attempt:  # an earlier attempt's view and what it wrote
            _remove(settings, job_id, int(number))
    view = view_dir(settings, job_id, attempt)
    if _mounted(view):
        return view  # a worker restarted mid-launch
    _remove(settings, job_id, attempt)
    view.mkdir(parents=True)
    if settings.workdir_overlay and _overlay(settings, job_id, attempt, source, view, user):
        return view
    _copy(settings, source, view)
    return view


def for_ranks(
    ranks: list[RankLaunch], settings: Settings, launch: LaunchJob, user: JobUser | None
) -> list[RankLaunch]:
    """`ranks` of a job run from a code root, each in the attempt's writable view of its folder (`make`);
    any other job's as they are."""
    entry = launch.spec.entrypoint
    if entry is None or entry.code is not None or not ranks or ranks[0].cwd is None:
        return ranks
    if settings.rank_runtime != "process":  # a rank pod sees the code root as its image or volume has it
        return ranks
    view = make(settings, str(launch.job_id), launch.attempt, ranks[0].cwd, user)
    return [dataclasses.replace(r, cwd=view) for r in ranks]


def release(settings: Settings, job_id: str, attempt: int) -> None:
    """The attempt's overlay unmounted (its writes stay in its upper layer until the next attempt)."""
    view = view_dir(settings, job_id, attempt)
    if _mounted(view) and _umount(view) != 0:
        log.warning("could not unmount %s: %s", view, os.strerror(ctypes.get_errno()))


def release_all(settings: Settings) -> None:
    """Every attempt's overlay on this node unmounted (the worker stops with no rank left)."""
    for view in (settings.data_dir.resolve() / "runs").glob(f"*/attempt-*/work-{settings.node_name}"):
        if _mounted(view):
            _umount(view)


def _overlay(
    settings: Settings, job_id: str, attempt: int, source: Path, view: Path, user: JobUser | None
) -> bool:
    if os.geteuid() != 0 or any(c in str(p) for p in (source, view) for c in _UNSAFE):
        return False
    layers = _layers(settings, job_id, attempt)
    upper, scratch = layers / "upper", layers / "scratch"
    for folder in (upper, scratch):
        folder.mkdir(parents=True, exist_ok=True)
    os.chmod(upper, stat.S_IMODE(source.stat().st_mode) | 0o700)
    if user is not None:
        os.chown(upper, user.uid, user.gid)  # the view's root: the job's user may create files in it
    options = f"lowerdir={source},upperdir={upper},workdir={scratch}"
    if _mount(view, options) != 0:
        log.info("overlayfs refused %s (%s): copying it", view, os.strerror(ctypes.get_errno()))
        shutil.rmtree(layers, ignore_errors=True)
        return False
    if user is not None:  # its folders the job's (a folder's copy-up is metadata only): new files anywhere
        for top, _, _ in os.walk(view):
            os.chown(top, user.uid, user.gid, follow_symlinks=False)
    return True


def _copy(settings: Settings, source: Path, view: Path) -> None:
    size = sum(
        os.lstat(Path(top) / name).st_size for top, _, files in os.walk(source) for name in files
    )  # fmt: skip
    if size > settings.workdir_copy_max_mb * MIB:
        message = (
            f"{source} holds {size / MIB:.0f} MB, over VIGIL_WORKDIR_COPY_MAX_MB "
            f"({settings.workdir_copy_max_mb:g}), and this node cannot lay an overlay over it: ship the "
            "code with `vigil submit --code DIR`, or raise the limit"
        )
        raise SpecError([{"field": "entrypoint.workdir", "message": message}])
    shutil.copytree(source, view, symlinks=True, dirs_exist_ok=True)


def _remove(settings: Settings, job_id: str, attempt: int) -> None:
    view = view_dir(settings, job_id, attempt)
    if _mounted(view):
        _umount(view)
    if not _mounted(view):
        shutil.rmtree(view, ignore_errors=True)
    shutil.rmtree(_layers(settings, job_id, attempt), ignore_errors=True)


def _mounted(path: Path) -> bool:
    with contextlib.suppress(OSError):
        return os.path.ismount(path)
    return False


def _libc() -> ctypes.CDLL:
    return ctypes.CDLL(None, use_errno=True)


def _mount(target: Path, options: str) -> int:
    return int(_libc().mount(b"overlay", os.fsencode(target), b"overlay", 0, options.encode()))


def _umount(target: Path) -> int:
    return int(_libc().umount2(os.fsencode(target), MNT_DETACH))
