"""The worker's stack dump: real py-spy on a real Python process stuck in a loader, every thread read,
and the dump bounded to one event."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from vigil_common.events import MAX_STACKS_BYTES, RankStacks, StackFrame, StacksDumped, ThreadStack
from vigil_worker.stacks import dump_rank, fit, py_spy

pytestmark = pytest.mark.skipif(py_spy() is None, reason="py-spy is not installed")

STUCK = textwrap.dedent(
    """
    import sys, threading, time

    class Loader:
        def __next__(self):
            threading.Event().wait()

    def beat():
        while True:
            time.sleep(1)

    threading.Thread(target=beat, name="heartbeat", daemon=True).start()
    print("ready", flush=True)
    next(Loader())
    """
)


@pytest.fixture
def stuck(tmp_path: Path):
    program = tmp_path / "loader.py"
    program.write_text(STUCK)
    proc = subprocess.Popen([sys.executable, str(program)], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
        yield proc.pid
    finally:
        proc.kill()
        proc.wait()


async def test_every_thread_of_a_rank_stuck_in_its_loader_is_read_main_thread_first(stuck: int):
    r = await dump_rank(3, stuck, timeout_s=10)
    assert r.error is None, r.error
    assert (r.rank, r.pid) == (3, stuck)
    main, *others = r.threads
    assert main.name == "MainThread" and [t.name for t in others] == ["heartbeat"]
    names = [f.function for f in main.frames]
    assert names[-1] == "<module>" and "Loader.__next__" in names  # innermost first
    loader = main.frames[names.index("Loader.__next__")]
    assert loader.file.endswith("loader.py") and loader.line == 6


async def test_a_process_that_is_gone_is_reported_with_py_spys_reason(tmp_path: Path):
    proc = await asyncio.create_subprocess_exec(sys.executable, "-c", "pass")
    await proc.wait()
    r = await dump_rank(0, proc.pid, timeout_s=10)
    assert r.threads == [] and r.error is not None and r.error.startswith("py-spy: ")
    missing = await dump_rank(0, 1, timeout_s=10, tool=str(tmp_path / "no-py-spy"))
    assert missing.error is not None and missing.error.startswith("py-spy did not start")


def test_a_dump_too_large_for_one_event_keeps_the_innermost_frames():
    deep = ThreadStack(
        name="MainThread",
        frames=[
            StackFrame(function=f"f{i}" + "x" * 200, file="/code/" + "d" * 200 + ".py", line=i)
            for i in range(64)
        ],
    )
    helpers = [ThreadStack(name=f"t{k}", frames=deep.frames) for k in range(8)]
    ranks = [RankStacks(rank=r, pid=r, threads=[deep, *helpers]) for r in range(16)]
    cut = fit(ranks)
    assert sum(len(r.model_dump_json()) for r in cut) <= MAX_STACKS_BYTES
    assert all(r.threads and r.threads[0].frames[0].function.startswith("f0") for r in cut)
    StacksDumped(node="n", command_id="c", ranks=cut, duration_s=0.0)  # it validates as one event
    with pytest.raises(ValueError, match="over the limit"):
        StacksDumped(node="n", command_id="c", ranks=ranks, duration_s=0.0)
