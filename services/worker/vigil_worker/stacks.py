"""A hung job's stacks: every thread of each of this node's ranks, read with py-spy (`py-spy dump --json`),
else by the rank itself (`vigil.stack_dump`: faulthandler on SIGUSR2, when the rank installed it).

py-spy reads the target's memory (ptrace): a worker running as root reads ranks that run as a job's
own uid, in the job's cgroup. The process is paused for the read (a few milliseconds), not changed. Each
rank is read at once, in parallel, within the time the guardian waits (`DumpStacks.within_s`); a rank
that cannot be read (gone, not Python, py-spy missing or refused) is reported with py-spy's reason, never
left out silently. The dump is trimmed to fit `events.MAX_STACKS_BYTES` (the outermost frames go first;
the innermost say where a rank is).

py-spy gets 60 % of the bound, the rank's own dump the rest: py-spy answers in tens of milliseconds, and
fails as fast where it cannot read a process (no ptrace, no py-spy)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import shutil
import sys
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from vigil.events import (
    MAX_FRAMES,
    MAX_STACKS_BYTES,
    MAX_THREADS,
    RankStacks,
    StackFrame,
    ThreadStack,
)
from vigil.stack_dump import SIGNAL, stacks_path

ERROR_CHARS = 500  # of py-spy's own words, when it fails


async def dump(
    rank: int, pid: int, exit_path: str | Path, bound_s: float, tool: str | None = None
) -> RankStacks:
    """One rank's stacks within `bound_s`: py-spy's, else the rank's own faulthandler dump, else py-spy's
    reason (with the fallback's, when it had one). `tool`: the py-spy to run (default: `py_spy()`)."""
    read = await dump_rank(rank, pid, bound_s * 0.6, tool)
    if read.error is None:
        return read
    own = await dump_by_signal(rank, pid, exit_path, bound_s * 0.4)
    if own is None:  # the rank installed no handler: a signal could end it
        return read
    if own.error is not None:
        return read.model_copy(update={"error": f"{read.error}; faulthandler: {own.error}"[:ERROR_CHARS]})
    return own


def py_spy() -> str | None:
    """The py-spy beside this interpreter (the worker's virtualenv), else on PATH; None when absent."""
    beside = Path(sys.executable).parent / "py-spy"
    return str(beside) if beside.is_file() else shutil.which("py-spy")


async def dump_rank(rank: int, pid: int, timeout_s: float, tool: str | None = None) -> RankStacks:
    """Every thread of the Python process `pid`, innermost frame first; with `error` when it cannot be
    read within `timeout_s`."""
    tool = tool or py_spy()
    if tool is None:
        return RankStacks(rank=rank, pid=pid, error="py-spy is not installed on this node")
    try:
        proc = await asyncio.create_subprocess_exec(
            tool,
            "dump",
            "--pid",
            str(pid),
            "--json",
            stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
        )
    except OSError as exc:
        return RankStacks(rank=rank, pid=pid, error=f"py-spy did not start: {exc}"[:ERROR_CHARS])
    try:
        out, err = await asyncio.wait_for(proc.communicate(), timeout_s)
    except TimeoutError:
        with contextlib.suppress(ProcessLookupError):
            proc.kill()
        await proc.wait()
        return RankStacks(rank=rank, pid=pid, error=f"py-spy did not answer within {timeout_s:.1f}s")
    if proc.returncode != 0:
        said = err.decode(errors="replace").strip().splitlines()
        why = said[0] if said else f"exit code {proc.returncode}"
        return RankStacks(rank=rank, pid=pid, error=f"py-spy: {why}"[:ERROR_CHARS])
    try:
        threads = parse(json.loads(out))
    except (ValueError, TypeError, KeyError) as exc:
        why = f"py-spy's output is not what was expected: {exc}"
        return RankStacks(rank=rank, pid=pid, error=why[:ERROR_CHARS])
    return RankStacks(rank=rank, pid=pid, threads=threads, tool="py-spy")


async def dump_by_signal(rank: int, pid: int, exit_path: str | Path, timeout_s: float) -> RankStacks | None:
    """The rank's own dump (`vigil.stack_dump`): SIGUSR2, then what it appends to its stacks file within
    `timeout_s`; None when it has no stacks file (no handler installed)."""
    path = stacks_path(exit_path)
    try:
        before = path.stat().st_size
    except FileNotFoundError:
        return None
    try:
        os.kill(pid, SIGNAL)
    except ProcessLookupError:
        return RankStacks(rank=rank, pid=pid, error="the process is gone")
    deadline, size = time.monotonic() + timeout_s, before
    while time.monotonic() < deadline:
        await asyncio.sleep(0.02)  # polling the file the rank's signal handler writes
        grown = path.stat().st_size
        if before < grown == size:
            break  # written, and no longer growing
        size = grown
    with path.open("rb") as fh:
        fh.seek(before)
        text = fh.read(1 << 20).decode(errors="replace")
    threads = parse_faulthandler(text)
    if not threads:
        return RankStacks(rank=rank, pid=pid, error=f"no stacks written within {timeout_s:.1f}s")
    return RankStacks(rank=rank, pid=pid, threads=threads, tool="faulthandler")


_THREAD = re.compile(r"^(?:Current thread|Thread) (0x[0-9a-fA-F]+) \(most recent call first\):$")
_FRAME = re.compile(r'^  File "(.*)", line (\d+) in (.*)$')


def parse_faulthandler(text: str) -> list[ThreadStack]:
    """faulthandler's text (per thread, frames innermost first) as `ThreadStack`s. It names no thread, so
    the one not started by `threading` (its outermost frame is not `_bootstrap`) is `MainThread`, first."""
    threads: list[tuple[str, list[StackFrame]]] = []
    for line in text.splitlines():
        if m := _THREAD.match(line):
            threads.append((m.group(1), []))
        elif (m := _FRAME.match(line)) and threads and len(threads[-1][1]) < MAX_FRAMES:
            threads[-1][1].append(
                StackFrame(function=m.group(3)[:256], file=m.group(1)[-4096:], line=int(m.group(2)))
            )
    out = []
    for ident, frames in threads:
        main = bool(frames) and frames[-1].function != "_bootstrap"
        out.append(ThreadStack(name="MainThread" if main else ident, frames=frames))
    out.sort(key=lambda t: t.name != "MainThread")
    return out[:MAX_THREADS]


def parse(dump: list[dict[str, Any]]) -> list[ThreadStack]:
    """py-spy's JSON (one object per thread, frames innermost first) as `ThreadStack`s, the main thread
    first, each bounded (`MAX_THREADS` threads, the innermost `MAX_FRAMES` frames, names and paths cut)."""
    threads = []
    for t in dump:
        frames = [
            StackFrame(
                function=str(f.get("name") or "?")[:256],
                file=str(f.get("filename") or "?")[-4096:],
                line=f["line"] if isinstance(f.get("line"), int) and f["line"] >= 0 else None,
            )
            for f in t["frames"][:MAX_FRAMES]
        ]
        name = str(t.get("thread_name") or t.get("thread_id") or "?")[:256]
        threads.append(ThreadStack(name=name, frames=frames))
    threads.sort(key=lambda t: t.name != "MainThread")
    return threads[:MAX_THREADS]


def fit(ranks: Iterable[RankStacks], budget: int = MAX_STACKS_BYTES) -> list[RankStacks]:
    """The dumps cut to `budget` bytes of JSON: threads' outermost frames first (down to 8 frames), then
    every thread but the main one; what cannot fit even so keeps its rank and pid with an error."""
    ranks = list(ranks)
    for keep in (MAX_FRAMES, 32, 16, 8):
        cut = [r.model_copy(update={"threads": [_inner(t, keep) for t in r.threads]}) for r in ranks]
        if _size(cut) <= budget:
            return cut
    cut = [r.model_copy(update={"threads": [_inner(t, 8) for t in r.threads[:1]]}) for r in ranks]
    if _size(cut) <= budget:
        return cut
    return [RankStacks(rank=r.rank, pid=r.pid, error="the dump did not fit in one event") for r in ranks]


def _inner(thread: ThreadStack, keep: int) -> ThreadStack:
    if len(thread.frames) <= keep:
        return thread
    return thread.model_copy(update={"frames": thread.frames[:keep]})


def _size(ranks: list[RankStacks]) -> int:
    return sum(len(r.model_dump_json()) for r in ranks)
