"""The worker's side of in-job restart: a rank whose collective failed waits in its process for its job's
next attempt (`vigil_trainer.park`), and the worker hands that attempt to it.

- A parked rank is seen by the monitor (its marker beside the exit file) and reported exited
  (`EXIT_PARKED`): the control plane judges the failure as any other. Its device is offered again.
- The job's next attempt placing the same rank on the same device here goes to the parked process
  (`hand_over`): moved into the new attempt's cgroup, and given on its Unix socket the launch a warm
  rank would get with its new log's descriptor. Only the ranks that are gone start new processes.
- A parked rank that the next attempt does not take (placed elsewhere, another job's launch on its
  device, the job ended) is ended as any rank is; one left waiting `PARKED_FOR_S` ends too.
- A rank of an older attempt still running when the next one places it here waits in a collective on a
  peer that is cut off (its node declared lost: no connection was closed). The worker tells it so
  (`cut`, on the rank's `cut_socket`): it cuts its connections, its collective fails, and it parks
  within `PARK_WINDOW_S` and is taken as above, rather than ended.
- A hung attempt's ranks end in two waves (`hung`): those whose stacks, dumped for the hang, wait
  in no collective (the hung ones) first; those that waited for them in a collective are cut as above
  (their peer's end fails their collective too), park, and take the next attempt as any survivor does.
"""

from __future__ import annotations

import logging
import os
import socket
import time

from vigil.events import LaunchJob
from vigil.handover import cut_socket, next_socket, parked_marker
from vigil_common.settings import Settings
from vigil_worker.cgroups import JobCgroup
from vigil_worker.launch import RankLaunch, handed_launch, warm_argv
from vigil_worker.procs import RankRecord, RankTable, RankToStart
from vigil_worker.tenancy import JobUser

log = logging.getLogger("vigil.worker")

PARKED_FOR_S = 60.0  # a parked rank no attempt took by then is ended (a relaunch comes in seconds)
# A rank cut, or whose hung peer ended, parks this soon or is ended (and started anew). As a rule it parks
# in milliseconds (its collective fails at once, then its Run closes: 47 ms in a stressed run's log), but
# once beside `stress --cpu 2` it had not 1.6 s after its cut, and the old 1.5 s ended it for a warm rank
# (test_spares). Only a rank that never parks (a snapshot's peer copy blocked on the dead peer) waits it out.
PARK_WINDOW_S = 5.0
HAND_OVER_S = 5.0  # the hand-over's connection and writes (the parked rank listens before its marker)
CUT_S = 1.0  # a cut's connection and answer (the rank's own thread answers, whatever its training does)


def newly_parked(record: RankRecord) -> str | None:
    """Why `record`'s process parked, once it has (and it was not ended meanwhile); else None."""
    if record.parked_at is not None or record.killed or not record.builtin:
        return None
    try:
        return parked_marker(record.exit_path).read_text(errors="replace").strip() or "a collective failed"
    except FileNotFoundError:
        return None


def parks(record: RankRecord, settings: Settings) -> bool:
    """`record`'s process parks when its collective fails (`launch.rank_env` allowed it)."""
    return record.builtin and settings.rank_runtime == "process"


def hung(
    table: RankTable, launch: LaunchJob, settings: Settings, waiting: tuple[int, dict[int, bool]] | None
) -> list[RankRecord]:
    """The ranks of `launch`'s job here that an older attempt left running and whose stacks (`waiting`:
    the attempt dumped, and whether each rank waited in a collective) put in no collective while a peer
    waited in one: the hung ones, ended first. Those that waited for them are cut (`cut_all`) and park.
    None unless the stacks of that very attempt were dumped here and its ranks park."""
    if waiting is None or launch.job_id is None:
        return []
    attempt, in_collective = waiting
    older = [r for r in table.running(launch.job_id) if r.attempt == attempt < launch.attempt]
    older = [r for r in older if r.parked_at is None and not r.killed and parks(r, settings)]
    if not any(in_collective.get(r.rank, False) for r in older):
        return []
    return [r for r in older if not in_collective.get(r.rank, False)]


def still_waiting(table: RankTable, launch: LaunchJob, node: str, settings: Settings) -> list[RankRecord]:
    """The ranks of `launch`'s job here that an older attempt left running, not parked, on a device the
    launch takes here, and that park: their peer is gone (the control plane replaced the attempt), so
    their collectives are to be cut (`cut`) and they park, to be taken rather than ended."""
    if launch.spec.entrypoint is not None or launch.job_id is None:
        return []
    devices = {p.device for p in launch.placement if p.node == node}
    return [
        r
        for r in table.running(launch.job_id)
        if r.attempt < launch.attempt
        and r.parked_at is None
        and not r.killed
        and r.device in devices
        and parks(r, settings)
    ]


def cut_all(table: RankTable, launch: LaunchJob, node: str, settings: Settings) -> list[RankRecord]:
    """Tell each of `still_waiting`'s ranks that its attempt was replaced (`cut`), and return them all:
    each parks, or ends, soon (one that could not be told may be parking already)."""
    waiting = still_waiting(table, launch, node, settings)
    for r in waiting:
        cut(r, f"attempt {launch.attempt} of the job replaces attempt {r.attempt}")
    return waiting


def cut(record: RankRecord, why: str) -> bool:
    """Tell `record`'s process that its attempt was replaced: it cuts its collectives' connections and
    parks. False when it cannot be told (it does not listen: ended, or parked by now)."""
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as conn:
            conn.settimeout(CUT_S)
            conn.connect(str(cut_socket(record.exit_path)))
            conn.sendall(why.encode()[:4000] + b"\n")
            answer = conn.recv(64).decode(errors="replace").strip()
    except OSError as exc:
        log.info("rank %d of %s: its collectives not cut (%s)", record.rank, record.job_id, exc)
        return False
    log.warning("rank %d of %s: cut %s connection(s) of its collectives: %s", record.rank, record.job_id,
                answer or "no answer:", why)  # fmt: skip
    return True


def waited_too_long(record: RankRecord, now: float | None = None) -> bool:
    return record.parked_at is not None and (now or time.time()) - record.parked_at > PARKED_FOR_S


def takers(table: RankTable, launch: LaunchJob, node: str) -> dict[int, RankRecord]:
    """The parked ranks of `launch`'s job here that its ranks on this node take over: the one on the same
    device, whatever rank it was (a job that shrank or grew numbers its ranks anew; the snapshots are the
    node's, not the process's); the built-in trainer only."""
    if launch.spec.entrypoint is not None or launch.job_id is None:
        return {}
    parked = {r.device: r for r in table.running(launch.job_id) if r.parked_at is not None and not r.killed}
    return {p.rank: parked[p.device] for p in launch.placement if p.node == node and p.device in parked}


def in_the_way(table: RankTable, launch: LaunchJob, node: str) -> list[RankRecord]:
    """Other jobs' parked ranks on the devices `launch` takes here: they let go first."""
    devices = {p.device for p in launch.placement if p.node == node}
    return [
        r
        for r in table.running()
        if r.parked_at is not None and r.job_id != launch.job_id and r.device in devices and not r.killed
    ]


def hand_over(
    table: RankTable,
    parked: RankRecord,
    rank: RankLaunch,
    who: RankToStart,
    user: JobUser | None,
    group: JobCgroup | None,
) -> RankRecord | None:
    """Give `parked`'s process the next attempt's rank `who`; None when it cannot take it (its socket
    or its process gone): the caller ends it and starts the rank as usual."""
    if warm_argv(rank.argv) is None or not parked.alive():
        return None
    try:
        if group is not None:  # as root: a job's user may not move itself between cgroups
            for procs in group.procs_files():
                with open(procs, "wb") as out:
                    out.write(str(parked.pid).encode())
        RankTable.clear(rank.log_path, rank.exit_path)
        log_fd = os.open(rank.log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    except OSError as exc:
        log.warning("rank %d of %s: its parked process cannot be handed over (%s)", who.rank, who.job_id, exc)
        return None
    line = handed_launch(rank)  # its user already the job's, its cgroup the new attempt's (above)
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as conn:
            conn.settimeout(HAND_OVER_S)
            conn.connect(str(next_socket(parked.exit_path)))
            sent = socket.send_fds(conn, [line], [log_fd])
            if sent < len(line):  # nothing more when all went (the rank may have closed its end by now)
                conn.sendall(line[sent:])
    except OSError as exc:
        log.warning("rank %d of %s: its parked process cannot be handed over (%s)", who.rank, who.job_id, exc)
        return None
    finally:
        os.close(log_fd)
    parked_marker(parked.exit_path).unlink(missing_ok=True)
    return table.hand_over(parked, who)
