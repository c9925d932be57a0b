import sys

import pytest

from vigil_worker.inventory import Inventory, _nvml
from vigil_worker.procs import RankTable, RankToStart, start_ticks


def start(table, tmp_path, code: str, rank: int = 0):
    who = RankToStart(
        job_id="j1", attempt=1, rank=rank, device=rank,
        log_path=tmp_path / f"r{rank}.log", exit_path=tmp_path / f"r{rank}.exit",
    )  # fmt: skip
    return table.start(who, [sys.executable, "-c", code], {})


def test_child_exit_code_and_log(tmp_path):
    table = RankTable(tmp_path / "state")
    r = start(table, tmp_path, "print('hello'); raise SystemExit(3)")
    table._children[r.pid].wait(30)
    ended = table.poll(r)
    assert ended is not None and ended.code == 3 and ended.signal is None
    assert (tmp_path / "r0.log").read_text().strip() == "hello"


def test_a_rank_that_aborts_in_its_teardown_ends_with_the_code_it_declared(tmp_path):
    """A rank that wrote its exit file (its emergency checkpoint done: 4) and then aborted as the
    interpreter tore down (gloo's threads, pytorch#179291) was preempted, not killed; one that declared
    nothing and aborted died of its signal."""
    table = RankTable(tmp_path / "state")
    code = "import os, pathlib; {} os.abort()"
    declared = start(
        table, tmp_path, code.format(f"pathlib.Path({str(tmp_path / 'r0.exit')!r}).write_text('4\\n');")
    )
    silent = start(table, tmp_path, code.format(""), rank=1)
    for r in (declared, silent):
        table._children[r.pid].wait(30)
    got = table.poll(declared)
    assert got is not None and (got.code, got.signal) == (4, None)
    got = table.poll(silent)
    assert got is not None and (got.code, got.signal) == (None, 6)


def test_a_new_table_finds_records_and_reads_exit_files(tmp_path):
    table = RankTable(tmp_path / "state")
    done = start(table, tmp_path, "pass", rank=0)
    lost = start(table, tmp_path, "pass", rank=1)
    table.attempts["j1"] = 1
    table.save()
    for r in (done, lost):
        table._children[r.pid].wait(30)
    (tmp_path / "r0.exit").write_text("7\n")  # what the rank program leaves behind

    restarted = RankTable(tmp_path / "state")  # as after a worker restart: not the parent any more
    restarted.load()
    assert restarted.attempts == {"j1": 1}
    by_rank = {r.rank: r for r in restarted.running()}
    assert not by_rank[0].alive() and start_ticks(done.pid) is None
    assert restarted.poll(by_rank[0]).code == 7
    assert restarted.poll(by_rank[1]).lost
    restarted.mark_reported(by_rank[0])
    again = RankTable(tmp_path / "state")
    again.load()
    assert [r.rank for r in again.running()] == [1]


def test_running_rank_is_found_alive_and_ended(tmp_path):
    table = RankTable(tmp_path / "state")
    r = start(table, tmp_path, "import time; time.sleep(60)")
    other = RankTable(tmp_path / "state")
    other.load()
    adopted = other.running()[0]
    assert adopted.alive() and other.poll(adopted) is None
    table.terminate(r)
    assert table._children[r.pid].wait(30) < 0  # ended by SIGTERM
    assert table.poll(r).signal == 15


@pytest.mark.skipif(_nvml() is not None, reason="this machine has NVIDIA GPUs")
def test_cpu_node_offers_cpu_slots():
    inv = Inventory.discover(3, "nodeA")
    assert [d.kind for d in inv.devices] == ["cpu"] * 3
    assert [d.uuid for d in inv.devices] == ["cpu-nodeA-0", "cpu-nodeA-1", "cpu-nodeA-2"]
    samples = inv.sample("nodeA", lambda i: None)
    assert all(
        s.device_kind == "cpu" and s.temperature_c is None and s.utilization_pct == 0.0 for s in samples
    )
