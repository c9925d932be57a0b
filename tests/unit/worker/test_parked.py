"""In-job restart's two sides without a job: which failures park a rank, which parked ranks a launch
takes, and the hand-over itself, to a real process parked with the trainer's own `park` code."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from vigil import handover
from vigil.events import LaunchJob, RankPlacement
from vigil.exits import EXIT_PARKED
from vigil.spec import JobSpec
from vigil_trainer import park
from vigil_worker import exit_report, parked
from vigil_worker.launch import RankLaunch
from vigil_worker.procs import RankTable, RankToStart

GLOO = (
    "[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection closed by peer "
    "[10.77.185.2]:56747. This is typically caused by a remote worker crashing."
)


def test_a_failed_collective_parks_and_nothing_else_does(monkeypatch: pytest.MonkeyPatch) -> None:
    assert park.collective_failed(RuntimeError(GLOO))
    assert park.collective_failed(RuntimeError("NCCL error in: ProcessGroupNCCL.cpp:1970, unhandled system"))
    try:  # a wrapper around the collective's error, as DeepSpeed or a user's code may raise
        try:
            raise RuntimeError(GLOO)
        except RuntimeError as inner:
            raise ValueError("the step failed") from inner
    except ValueError as outer:
        assert park.collective_failed(outer)
    for other in (RuntimeError("CUDA out of memory"), ValueError("Connection reset by peer"), KeyError("x")):
        assert not park.collective_failed(other), other
    monkeypatch.delenv(handover.PARK_ENV, raising=False)
    monkeypatch.setenv("VIGIL_EXIT_FILE", "/tmp/x.exit")
    assert not park.may_park(RuntimeError(GLOO))  # its worker does not hand over: it exits as before
    monkeypatch.setenv(handover.PARK_ENV, "1")
    assert park.may_park(RuntimeError(GLOO)) and not park.may_park(RuntimeError("CUDA out of memory"))


def launch(job: str, attempt: int, devices: dict[int, int], entrypoint: bool = False) -> LaunchJob:
    spec = JobSpec(name="p", **({"entrypoint": {"argv": ["python", "x.py"]}} if entrypoint else {}))
    return LaunchJob(
        job_id=job, attempt=attempt, spec=spec, master_addr="127.0.0.1", master_port=29500,
        placement=[RankPlacement(rank=r, node="n", device=d, local_rank=r) for r, d in devices.items()],
    )  # fmt: skip


def record(table: RankTable, tmp_path: Path, job: str, rank: int, device: int, code: str = "") -> object:
    who = RankToStart(
        job_id=job, attempt=1, rank=rank, device=device, log_path=tmp_path / f"{job}-{rank}.log",
        exit_path=tmp_path / f"{job}-{rank}.exit", token="t", builtin=True,
    )  # fmt: skip
    return table.start(who, [sys.executable, "-c", code or "import time; time.sleep(60)"], {})


def test_a_launch_takes_its_jobs_parked_ranks_on_the_same_device_and_others_let_go(tmp_path: Path) -> None:
    table = RankTable(tmp_path / "state")
    try:
        same, moved, other = (
            record(table, tmp_path, j, r, d) for j, r, d in (("j1", 0, 0), ("j1", 1, 1), ("j2", 0, 2))
        )
        for r in (same, moved, other):
            r.parked_at = time.time()  # type: ignore[attr-defined]
        nxt = launch("j1", 2, {0: 0, 1: 2})  # rank 1 moves to device 2, where j2's parked rank waits
        assert parked.takers(table, nxt, "n") == {0: same}
        assert parked.in_the_way(table, nxt, "n") == [other]
        assert parked.takers(table, launch("j1", 2, {0: 0, 1: 1}, entrypoint=True), "n") == {}  # own program
        assert parked.waited_too_long(same, time.time() + parked.PARKED_FOR_S + 1)  # type: ignore[arg-type]
        exited = exit_report.rank_parked(same, "n")  # type: ignore[arg-type]
        assert (exited.exit_code, exited.failure, exited.signal) == (EXIT_PARKED, "error", None)
    finally:
        for r in table.running():
            table.signal(r, 9)


def test_a_hangs_ranks_in_no_collective_are_the_ones_ended_first(tmp_path: Path) -> None:
    """A hang's stacks: rank 0 in no collective (hung), ranks 1 and 2 waiting on it in one. Only rank 0 is
    ended first; the waiters are cut and park. Stacks of another attempt, or none waiting, split nothing."""
    from vigil_common.settings import Settings

    table = RankTable(tmp_path / "state")
    settings = Settings(rank_runtime="process")
    try:
        hung_rank, *_ = (record(table, tmp_path, "j1", r, r) for r in (0, 1, 2))
        nxt = launch("j1", 2, {0: 0, 1: 1, 2: 2})
        stacks = {0: False, 1: True, 2: True}
        assert parked.hung(table, nxt, settings, (1, stacks)) == [hung_rank]
        assert parked.hung(table, nxt, settings, (2, stacks)) == []  # not this attempt's stacks
        assert parked.hung(table, nxt, settings, None) == []
        assert parked.hung(table, nxt, settings, (1, dict.fromkeys(stacks, False))) == []  # nobody waits
        assert parked.hung(table, nxt, Settings(rank_runtime="kubernetes"), (1, stacks)) == []  # no parking
    finally:
        for r in table.running():
            table.signal(r, 9)


PARKED_RANK = """
import json, os, sys
from vigil_trainer import park
park.release_process_group = lambda: None  # no process group in this test
park.begin("RuntimeError: Connection closed by peer")
got = park.wait_for_next_attempt()
launch, log = got
os.write(log, json.dumps(launch["argv"]).encode())  # its output, on the log the worker opened
"""


def test_the_worker_hands_the_next_attempt_to_the_parked_process(tmp_path: Path) -> None:
    table = RankTable(tmp_path / "state")
    exit_file = tmp_path / "j1-0.exit"
    who1 = RankToStart(
        job_id="j1", attempt=1, rank=0, device=0, log_path=tmp_path / "a1.log", exit_path=exit_file,
        token="t1", builtin=True,
    )  # fmt: skip
    env = {**os.environ, "VIGIL_EXIT_FILE": str(exit_file), "PYTHONPATH": os.pathsep.join(sys.path)}
    old = table.start(who1, [sys.executable, "-c", PARKED_RANK], env)
    deadline = time.monotonic() + 60
    while (why := parked.newly_parked(old)) is None:  # the monitor's view: it parked
        assert time.monotonic() < deadline, (tmp_path / "a1.log").read_text()
        time.sleep(0.05)  # polling a file the child writes, with a deadline
    assert "Connection closed by peer" in why

    run_dir = tmp_path / "attempt-2"
    rank = RankLaunch(
        placement=RankPlacement(rank=0, node="n", device=0, local_rank=0),
        argv=[sys.executable, "-m", "vigil_trainer", "--launch", "x.json"],
        env={"RANK": "0"}, cwd=None, token="t2", log_path=run_dir / "a2.log", exit_path=run_dir / "rank-0.exit",
    )  # fmt: skip
    who2 = RankToStart(
        job_id="j1", attempt=2, rank=0, device=0, log_path=rank.log_path, exit_path=rank.exit_path,
        token="t2", builtin=True,
    )  # fmt: skip
    kept = parked.hand_over(table, old, rank, who2, None, None)
    assert kept is not None and kept.pid == old.pid and (kept.attempt, kept.token) == (2, "t2")
    assert [r.attempt for r in table.running("j1")] == [2] and old.reported
    table._children[kept.pid].wait(60)
    assert json.loads(rank.log_path.read_text()) == ["--launch", "x.json"]  # written on the handed log
    assert not handover.parked_marker(exit_file).exists() and not handover.next_socket(exit_file).exists()


REJOIN_PAIR = """
import datetime, os, sys
import torch, torch.distributed as dist
from vigil_trainer import park
rank, first, second = int(sys.argv[1]), sys.argv[2], sys.argv[3]
if rank == 0:  # the survivor: handed an attempt whose group never formed (its peer was gone), then the next
    try:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{first}", rank=0, world_size=2,
                                timeout=datetime.timedelta(seconds=1))
    except Exception as exc:
        print("the first attempt's group failed:", type(exc).__name__, flush=True)
    else:
        sys.exit("a group of two formed with one rank")
    park.release_process_group()  # what a parked rank does before it takes the next attempt
dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{second}", rank=rank, world_size=2,
                        timeout=datetime.timedelta(seconds=60))  # a loaded machine's imports: wide
total = torch.ones(1)
dist.all_reduce(total)
print("sum", total.item(), flush=True)
os._exit(0)  # not the interpreter's teardown: gloo's threads may abort it (pytorch#179291), as a rank's does
"""


def test_a_survivor_whose_group_never_formed_forms_the_next_with_a_fresh_peer() -> None:
    """A parked rank handed an attempt that it could not form (its peer's node gone: cut, or timed out in
    the rendezvous) parks again and takes the attempt after; its new peer is a fresh process. torch had
    named the failed group "1" in the survivor, so its next one too, while the fresh peer's is "0": both
    waited for each other's keys (`vigil bench elastic` beside the stress failed so). Released, the
    survivor names it "0" again: the two form it and reduce."""
    from vigil_common.embedded import free_port

    first = second = str(free_port())
    while second == first:  # two attempts' rendezvous, on ports of their own
        second = str(free_port())
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    procs = [
        subprocess.Popen([sys.executable, "-c", REJOIN_PAIR, str(r), first, second], env=env, text=True,
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        for r in (0, 1)
    ]  # fmt: skip
    try:
        outs = [p.communicate(timeout=120)[0] for p in procs]
    finally:
        for p in procs:
            p.kill()
    assert "the first attempt's group failed" in outs[0], outs[0]
    for p, out in zip(procs, outs, strict=True):
        assert p.returncode == 0 and "sum 2.0" in out, out[-3000:]


CUT_OFF_PAIR = """
import os, sys, time
import torch, torch.distributed as dist
from vigil_trainer import park
rank, port = int(sys.argv[1]), sys.argv[2]
dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
dist.all_reduce(torch.ones(1))
if rank == 1:  # the peer cut off: alive, silent, no connection closed
    time.sleep(120)
    os._exit(0)
park.release_process_group = lambda: None  # the group's teardown is not what is tested
with park.cuttable():
    try:
        dist.all_reduce(torch.ones(1))  # waits on rank 1 for good, but for the cut
    except Exception as exc:
        assert park.may_park(exc), exc
        park.begin(f"{type(exc).__name__}: {exc}")
print("parked", flush=True)
os._exit(0)
"""


def test_a_survivor_waiting_on_a_peer_cut_off_parks_once_its_worker_cuts_its_collectives(
    tmp_path: Path,
) -> None:
    """Rank 0 waits in a gloo collective on rank 1, which is alive and says nothing (its host cut off: no
    connection closed). The job's next attempt places rank 0 on the same device here: the worker tells it
    its attempt was replaced, it cuts its connections, its collective fails, and it parks to be taken."""
    from vigil_common.settings import Settings

    table = RankTable(tmp_path / "state")
    port = str(29600 + os.getpid() % 300)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path), handover.PARK_ENV: "1"}
    ranks = []
    for r in (0, 1):
        who = RankToStart(
            job_id="j1", attempt=1, rank=r, device=r, log_path=tmp_path / f"r{r}.log",
            exit_path=tmp_path / f"r{r}.exit", token="t", builtin=True,
        )  # fmt: skip
        ranks.append(table.start(who, [sys.executable, "-c", CUT_OFF_PAIR, str(r), port],
                                 {**env, "VIGIL_EXIT_FILE": str(who.exit_path)}))  # fmt: skip
    survivor = ranks[0]
    try:
        deadline = time.monotonic() + 120
        while not handover.cut_socket(survivor.exit_path).exists():  # it trains (the group formed)
            assert time.monotonic() < deadline and survivor.alive(), (tmp_path / "r0.log").read_text()
            time.sleep(0.05)  # polling a file the child makes, with a deadline
        settings = Settings(rank_runtime="process")
        nxt = launch("j1", 2, {0: 0})
        assert parked.still_waiting(table, nxt, "n", settings) == [survivor]  # rank 1's device not here
        assert parked.still_waiting(table, launch("j1", 2, {0: 0}, entrypoint=True), "n", settings) == []
        assert parked.cut_all(table, nxt, "n", settings) == [survivor]
        while (why := parked.newly_parked(survivor)) is None:
            assert time.monotonic() < deadline, (tmp_path / "r0.log").read_text()
            time.sleep(0.05)
        assert "Connection closed by peer" in why, why
        assert ranks[1].alive()  # the peer said nothing: the cut alone failed the collective
        assert not parked.cut(survivor, "again")  # parked: it no longer listens for a cut
    finally:
        for r in table.running():
            table.signal(r, 9)


ALONE = """
import sys, types
from vigil_trainer import park
from vigil_worker import parked
exit_file = sys.argv[1]
with park.cuttable():
    park.raise_if_cut()  # nothing cut: it trains on
    assert parked.cut(types.SimpleNamespace(exit_path=exit_file, rank=0, job_id="j1"), "attempt 2 replaces 1")
    try:
        park.raise_if_cut()
    except park.CollectivesCut as exc:
        assert park.may_park(exc), exc
        print("cut:", exc)
with park.cuttable():  # the next attempt in this process starts uncut
    park.raise_if_cut()
print("uncut")
"""


def test_a_rank_alone_in_its_world_parks_at_its_next_step_once_cut(tmp_path: Path) -> None:
    """A rank with no peer (a job shrunk to one rank, grown back) has no collective that a cut can fail:
    it parks at its next step's start instead. In a process of its own: a cut shuts down every TCP
    connection of the process it runs in."""
    exit_file = tmp_path / "r0.exit"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path), handover.PARK_ENV: "1",
           "VIGIL_EXIT_FILE": str(exit_file)}  # fmt: skip
    out = subprocess.run(
        [sys.executable, "-c", ALONE, str(exit_file)], env=env, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines() == [
        "cut: the worker cut this rank's collectives: attempt 2 replaces 1",
        "uncut",
    ], out.stdout + out.stderr
    assert not handover.cut_socket(exit_file).exists()  # the listener went with its attempt
