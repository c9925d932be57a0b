"""A rank whose collective failed waits in its process for its job's next attempt (in-job restart).

When a peer dies (its machine lost, its process killed), the survivors' next collective fails: gloo reads
"Connection closed by peer", NCCL reports its error or its timeout. Relaunching the survivors too would
start their processes again (imports, CUDA context) only to rebuild the same rank. Instead a survivor
of the built-in trainer, started by a worker that allows it (`PARK_ENV`), parks:

1. it closes its `vigil.Run` (its events out, its last snapshot's work on its own thread done);
2. then (`begin`) it listens on a Unix socket beside its exit file (`next_socket`, 0600) and writes the
   parked marker (`parked_marker`, the failure's text): the worker reports the rank as exited
   (`EXIT_PARKED`), so that the control plane judges the failure as it judges any (the peer's node asked,
   lost, the job requeued), and a relaunch that comes fast finds it. Not before the Run is closed: a
   snapshot's peer copy can stay blocked in gloo after its peer is gone (seen once in three runs of `vigil
   bench elastic`, and made likely by shutting the connections down under it), and a rank so held must
   not be handed an attempt (the worker ends a rank that has not parked, as before in-job restart);
   it destroys the process group and drops DeepSpeed's cached groups (`ds_compat.forget_groups`), and
   frees what the engine held;
3. it waits for the worker's connection. The worker hands it the job's next attempt when that attempt
   places this rank on the same node and device: a warm rank's launch (`vigil.handover.Launch`) and
   the new log's descriptor (SCM_RIGHTS: the logs' folder is not the job user's), with the process
   already moved into the new attempt's cgroup. The rank takes its log, token, folder and environment
   (`vigil.handover.become_rank`) and runs `rank.main` again: a new process group at the new rendezvous, a
   new engine, and the newest whole in-memory snapshot restored, as any relaunch does.

A peer cut off the network closes no connection: the survivors' collectives would wait for their timeout
(gloo's 30 minutes), and aborting the process group does not unblock a gloo collective. So while it trains
such a rank listens on `cut_socket` (`cuttable`): when its job's next attempt comes and the rank is still
running (its peer's node was declared lost), its worker says so there, and the rank shuts down its own
connections (`cut_connections`: every connected TCP socket of the process, gloo's pairs and the store's).
The collective fails at once ("Connection closed by peer") and the rank parks as above.

The worker ends a parked rank the next attempt does not take (placed elsewhere, another job on its
device, the job ended, or waited too long). Only the lost ranks start new processes.
"""

from __future__ import annotations

import contextlib
import gc
import json
import logging
import os
import socket
import stat
import threading
from collections.abc import Iterator
from pathlib import Path

from vigil import protocol as proto
from vigil.handover import PARK_ENV, Launch, cut_socket, next_socket, write_parked_marker

log = logging.getLogger("vigil.rank")

HANDED_MAX_BYTES = 1 << 20  # a launch's JSON line (its environment holds the job's spec)
CUT_REASON_MAX_BYTES = 4096
# What a failed collective says (gloo's transport, NCCL, c10d's store), in the exception or its causes.
COLLECTIVE_FAILURES = (
    "Connection closed by peer",
    "Connection reset by peer",
    "Broken pipe",
    "Timed out waiting",
    "NCCL error",
    "NCCL communicator was aborted",
    "DistNetworkError",
    "DistBackendError",
)


_listening: socket.socket | None = None  # `begin`'s, until `wait_for_next_attempt`
_cut: str | None = None  # why the worker cut this attempt's collectives (`cuttable`'s thread sets it)


class CollectivesCut(RuntimeError):
    """The worker cut this rank's collectives (its attempt was replaced): raised at the next step's start
    when no collective failed first (a rank alone in its world has none that can)."""


def collective_failed(exc: BaseException) -> bool:
    """`exc` (or what caused it) is a collective that lost its peer."""
    seen: set[int] = set()
    e: BaseException | None = exc
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        text = f"{type(e).__name__}: {e}"
        if isinstance(e, CollectivesCut) or (
            isinstance(e, RuntimeError | ConnectionError | TimeoutError)
            and any(marker in text for marker in COLLECTIVE_FAILURES)
        ):
            return True
        e = e.__cause__ or e.__context__
    return False


def handed_over() -> bool:
    """The worker that started this rank hands a parked rank its job's next attempt."""
    return os.environ.get(PARK_ENV) == "1" and bool(os.environ.get(proto.EXIT_FILE_ENV))


def may_park(exc: BaseException) -> bool:
    """Park on `exc`: a collective failed, and the worker that started this rank hands over."""
    return handed_over() and collective_failed(exc)


@contextlib.contextmanager
def cuttable() -> Iterator[None]:
    """While the block runs, a rank that may park listens on `cut_socket` beside its exit file: its worker
    connects when the job's next attempt comes and this rank still runs (a peer cut off), and the rank
    cuts its collectives' connections (`cut_connections`) so that they fail now and it parks."""
    global _cut
    _cut = None  # a new attempt in this process: nothing cut yet
    if not handed_over():
        yield
        return
    path = cut_socket(os.environ[proto.EXIT_FILE_ENV])
    try:
        listener = _listen(path, backlog=4)
    except OSError as exc:  # a path too long for a socket's address, say: the relaunch ends this rank
        log.warning("cannot listen on %s (%s): a peer cut off ends this rank at the relaunch", path, exc)
        yield
        return
    serving = threading.Thread(target=_serve_cuts, args=(listener,), name="vigil-cut", daemon=True)
    serving.start()
    try:
        yield
    finally:
        with contextlib.suppress(OSError):
            listener.shutdown(socket.SHUT_RDWR)  # wakes the accept (Linux)
        listener.close()
        serving.join(timeout=5)
        path.unlink(missing_ok=True)


def _listen(path: Path, backlog: int) -> socket.socket:
    """A Unix socket listening at `path` (made anew), for its owner only (the worker connects as root)."""
    path.unlink(missing_ok=True)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        listener.bind(str(path))
        os.chmod(path, 0o600)
        listener.listen(backlog)
    except OSError:
        listener.close()
        raise
    return listener


def raise_if_cut() -> None:
    """At a step's start: raise `CollectivesCut` once the worker has cut this attempt's collectives (a
    rank whose collectives did not fail of it, one alone in its world, parks here)."""
    if _cut is not None:
        raise CollectivesCut(f"the worker cut this rank's collectives: {_cut}")


def _serve_cuts(listener: socket.socket) -> None:
    global _cut
    while True:
        try:
            conn, _ = listener.accept()  # the worker, as root
        except OSError:
            return  # closed: the block ended
        with conn:
            try:
                conn.settimeout(2.0)
                reason = conn.recv(CUT_REASON_MAX_BYTES).decode(errors="replace").strip()
                _cut = reason or "its attempt was replaced"
                cut = cut_connections()
                log.warning("the worker cut %d connection(s) of this rank's collectives: %s", cut, reason)
                conn.sendall(f"{cut}\n".encode())
            except OSError as exc:
                log.warning("a cut from the worker failed: %s", exc)


def cut_connections() -> int:
    """Shut down every connected TCP socket of this process (gloo's pairs, the store's client and the
    connections it serves): a collective blocked on them fails at once. How many were cut."""
    cut = 0
    for name in os.listdir("/proc/self/fd"):
        try:
            fd = int(name)
            if not stat.S_ISSOCK(os.fstat(fd).st_mode):
                continue
            sock = socket.socket(fileno=fd)
        except (ValueError, OSError):
            continue  # gone since the listing, or not a socket
        try:
            if sock.family in (socket.AF_INET, socket.AF_INET6) and sock.type == socket.SOCK_STREAM:
                sock.getpeername()  # connected: a listening socket has none
                sock.shutdown(socket.SHUT_RDWR)
                cut += 1
        except OSError:
            pass
        finally:
            sock.detach()  # the descriptor stays the process's
    return cut


def begin(reason: str) -> None:
    """Once the failed attempt's Run is closed: listen beside the exit file and write the marker, so that
    the worker may hand the next attempt over (it queues on the socket) while this rank still lets go of
    the process group. A rank that cannot listen exits as before."""
    global _listening
    exit_file = Path(os.environ[proto.EXIT_FILE_ENV])
    path = next_socket(exit_file)
    try:
        listener = _listen(path, backlog=1)
    except OSError as exc:  # a path too long for a socket's address, say
        log.error("parked: cannot listen on %s (%s): exiting", path, exc)
        return
    _listening = listener
    write_parked_marker(exit_file, reason)


def wait_for_next_attempt() -> tuple[Launch, int] | None:
    """Let go of the failed process group and wait for the job's next attempt here (`begin` first): its
    launch and its log's descriptor (the worker opens the log: its folder is not the job user's)."""
    global _listening
    listener, _listening = _listening, None
    if listener is None:
        return None
    release_process_group()
    log.warning("parked: a collective failed; waiting in this process for the job's next attempt")
    for handler in logging.getLogger().handlers:
        handler.flush()
    with listener:
        conn, _ = listener.accept()  # the worker, as root
    next_socket(os.environ[proto.EXIT_FILE_ENV]).unlink(missing_ok=True)
    with conn:
        data, fds, _, _ = socket.recv_fds(conn, HANDED_MAX_BYTES, 1)
        while data and not data.endswith(b"\n"):
            more = conn.recv(HANDED_MAX_BYTES)
            if not more:
                break
            data += more
    if not data.strip() or len(fds) != 1:
        for fd in fds:
            os.close(fd)
        log.warning("parked: the worker let go (the next attempt is not here)")
        return None
    launch: Launch = json.loads(data)
    return launch, fds[0]


def _forget_group_names() -> None:
    """Name this process's next default group "0", as a fresh process names its own.

    torch names a default group by a counter (`distributed_c10d._world.group_count`, the store's key
    prefix) taken before its rendezvous, and resets it only when a formed group is destroyed. An attempt
    whose group never formed (cut while it waited for a peer that was gone) leaves it at 1: this process's
    next group would be "1" and a fresh peer's "0", each waiting for the other's keys until the timeout
    (`vigil bench elastic` beside `stress --cpu 2`: three attempts judged hung in `_new_process_group_helper`,
    the job failed). The one name of torch's internals Vigil sets; tests/unit/worker/test_parked.py forms a
    group after a failed one."""
    from torch.distributed import distributed_c10d

    distributed_c10d._world.group_count = 0


def release_process_group() -> None:
    """Destroy the failed process group (what it says once a peer is gone is no use) and DeepSpeed's hold
    on it; collect what the dead engine held (a GPU's memory too)."""
    import torch
    import torch.distributed as dist

    from vigil.integrations import ds_compat

    if dist.is_initialized():
        with contextlib.suppress(Exception):  # a group whose peer is gone may fail to shut down cleanly
            dist.destroy_process_group()
    _forget_group_names()
    ds_compat.forget_groups()
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
