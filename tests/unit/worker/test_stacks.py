"""The worker's stack dump: real py-spy on a real Python process stuck in a loader, every thread read;
the rank's own faulthandler dump when py-spy cannot read it (and no signal to a rank without the
handler); the dump bounded to one event."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from vigil.events import MAX_STACKS_BYTES, RankStacks, StackFrame, StacksDumped, ThreadStack
from vigil_worker.stacks import dump, dump_rank, fit, parse_faulthandler, py_spy

needs_py_spy = pytest.mark.skipif(py_spy() is None, reason="py-spy is not installed")

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


@needs_py_spy
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


@needs_py_spy
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


OWN_DUMP = STUCK.replace(
    "import sys, threading, time",
    "import sys, threading, time\nimport vigil.stack_dump\nvigil.stack_dump.install()",
)


@pytest.fixture
def stuck_with_handler(tmp_path: Path):
    program, exit_path = tmp_path / "loader.py", tmp_path / "rank-1.exit"
    program.write_text(OWN_DUMP)
    env = {**os.environ, "VIGIL_EXIT_FILE": str(exit_path)}
    proc = subprocess.Popen([sys.executable, str(program)], stdout=subprocess.PIPE, text=True, env=env)
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
        yield proc, exit_path
    finally:
        proc.kill()
        proc.wait()


async def test_a_rank_py_spy_cannot_read_dumps_its_own_stacks(stuck_with_handler, tmp_path: Path):
    proc, exit_path = stuck_with_handler
    r = await dump(1, proc.pid, exit_path, 2.0, tool=str(tmp_path / "no-py-spy"))
    assert r.error is None and r.tool == "faulthandler", r.error
    main, *others = r.threads
    assert main.name == "MainThread" and len(others) == 1
    assert [f.function for f in main.frames][-2:] == ["__next__", "<module>"]
    assert main.frames[-2].line == 8 and main.frames[-2].file.endswith("loader.py")
    assert proc.poll() is None  # the signal dumped, it did not end the rank
    again = await dump(1, proc.pid, exit_path, 2.0, tool=str(tmp_path / "no-py-spy"))
    assert again.threads == r.threads  # only the new dump is read, not the file's earlier ones


async def test_a_rank_without_the_handler_is_never_signalled(stuck: int, tmp_path: Path):
    r = await dump(0, stuck, tmp_path / "rank-0.exit", 1.0, tool=str(tmp_path / "no-py-spy"))
    assert r.threads == [] and r.error is not None and r.error.startswith("py-spy did not start")
    os.kill(stuck, 0)  # still alive: SIGUSR2's default action would have ended it


def test_faulthandlers_text_is_read_main_thread_first():
    text = textwrap.dedent(
        """\
        Thread 0x00007f1 (most recent call first):
          File "/usr/lib/python3.11/threading.py", line 331 in wait
          File "/usr/lib/python3.11/threading.py", line 1002 in _bootstrap

        Current thread 0x00007f0 (most recent call first):
          File "/code/data.py", line 88 in __next__
          File "/code/train.py", line 60 in <module>
        """
    )
    helper, main = parse_faulthandler(text)[1], parse_faulthandler(text)[0]
    assert main.name == "MainThread" and [f.function for f in main.frames] == ["__next__", "<module>"]
    assert helper.name == "0x00007f1" and helper.frames[0] == StackFrame(
        function="wait", file="/usr/lib/python3.11/threading.py", line=331
    )
