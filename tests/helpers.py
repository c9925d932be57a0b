"""Test helpers shared by every suite: a service run in-process or as its own `vigil` process, and
waiting on conditions (never on sleeps alone), and the synthetic step events tests publish."""

from __future__ import annotations

import asyncio
import contextlib
import math
import os
import signal
import subprocess
import sys
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from pathlib import Path
from typing import Any

from vigil.events import LaunchJob, RankPlacement, StepCompleted
from vigil.spec import JobSpec
from vigil_common import subjects
from vigil_common.settings import Settings


@contextlib.asynccontextmanager
async def service(
    run: Callable[[Settings, asyncio.Event], Awaitable[None]], settings: Settings
) -> AsyncIterator[tuple[asyncio.Task[None], asyncio.Event]]:
    """`run(settings, stop)` as a task; stopped (gracefully) on the way out unless already done."""
    stop = asyncio.Event()
    task = asyncio.create_task(run(settings, stop))
    try:
        yield task, stop
    finally:
        stop.set()
        if not task.done():
            await asyncio.wait_for(task, 30)
        elif not task.cancelled() and task.exception():
            raise task.exception()  # type: ignore[misc]


async def eventually(check: Callable[[], Awaitable[Any]], *, timeout: float = 30.0, what: str = "") -> Any:
    """Poll the async `check` until it returns something truthy (a condition on state, with a deadline);
    fail after `timeout` seconds, naming `what` and the last value seen."""
    deadline = asyncio.get_running_loop().time() + timeout
    last: Any = None
    while True:
        last = await check()
        if last:
            return last
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what or check}; last: {last!r}")
        await asyncio.sleep(0.05)  # polling interval of a condition wait


async def launch_on(
    bus: Any,
    job_id: str,
    nodes: Mapping[int, str],
    attempt: int = 1,
    guardian: Mapping[str, Any] | None = None,
) -> LaunchJob:
    """Publish the launch that places the job's ranks (rank -> node): what the scheduler stores before
    any rank runs. Receivers count a step or status event only from its rank's node (`vigil_common.origin`),
    so a test that publishes them as workers would publishes this first."""
    launch = LaunchJob(
        job_id=job_id,
        attempt=attempt,
        spec=JobSpec(name="synthetic", guardian=dict(guardian or {})),
        master_addr="127.0.0.1",
        master_port=29500,
        placement=[RankPlacement(rank=r, node=n, device=0, local_rank=0) for r, n in sorted(nodes.items())],
    )
    await bus.publish(subjects.launch(job_id), launch)
    return launch


# A synthetic job steps only when its test publishes its steps, and is silent between them as long as the
# test waits (for a guardian's restart or a hand-over): a silence that long is a hang by default (10 x the
# p99 step time, which is then the gaps between the test's bursts), and an incident no such test expects (a
# CI run's guardian judged one 8 s after a job's last step). Merged under a test's own guardian settings:
# a test that makes a job silent on purpose sets its own `hang_timeout_s`, the cap of every hang limit.
NEVER_HUNG: dict[str, Any] = {"hang_timeout_s": 3600.0, "hang_step_multiple": 10_000.0}


def step_completed(
    job_id: str,
    step: int,
    rank: int = 0,
    *,
    loss: float = 2.0,
    attempt: int = 1,
    node: str | None = None,
    **fields: Any,
) -> StepCompleted:
    """A rank's step as the SDK reports it, with plausible values for what a test does not name: only the
    fields a test cares about are passed (`fields` overrides any default, `occurred_at` included). Node
    `n<rank>` unless named; `local_finite` follows the loss; the batch is the step's own data position."""
    defaults: dict[str, Any] = {
        "local_finite": math.isfinite(loss), "grad_norm": 1.0, "lr": 1e-3, "tokens": 100, "tokens_per_s": 1000.0,
        "step_time_s": 0.1, "comm_time_s": 0.01, "data_position": step,
    }  # fmt: skip
    return StepCompleted(
        job_id=job_id, attempt=attempt, rank=rank, node=f"n{rank}" if node is None else node, step=step,
        loss=loss, **{**defaults, **fields},
    )  # fmt: skip


def stop(proc: subprocess.Popen[bytes], timeout_s: float = 20.0) -> None:
    """SIGTERM, then SIGKILL when it has not exited after `timeout_s`: a server a test started."""
    proc.terminate()
    try:
        proc.wait(timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


class ServiceProcess:
    """`vigil <command>` as a process of its own, with `env` (VIGIL_*) on a clean environment and its
    output in `log`: what a test kills with SIGKILL to see another process take over."""

    def __init__(self, command: str, env: Mapping[str, str], log: Path) -> None:
        self.log = log
        full = {k: v for k, v in os.environ.items() if not k.startswith("VIGIL_")} | dict(env)
        with log.open("ab") as out:
            self.proc = subprocess.Popen(
                [str(Path(sys.executable).parent / "vigil"), command],
                env=full,
                stdout=out,
                stderr=subprocess.STDOUT,
            )

    def kill(self) -> None:
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(10)

    def stop(self) -> None:
        """SIGINT (a clean stop), SIGKILL after 20 s."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


async def stored(bus: Any, stream: subjects.StreamSpec, subject: str) -> int:
    """How many messages `stream` holds on `subject`, by the stream's own count: absence proved by the
    stream, not by a silence (a duplicate id is dropped by JetStream, any other counts)."""
    subject = subjects.stored(subject)  # as the stream stores it
    info = await bus.js.stream_info(stream.name, subjects_filter=subject)
    return (info.state.subjects or {}).get(subject, 0)
