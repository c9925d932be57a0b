"""The GPU check's HF Trainer check (issue 44, section 3): a program that brings its own training code, on
the device.

`hf_trainer_on_device`: one rank of the Hugging Face Trainer example (examples/byo/hf_trainer.py, with
`vigil.integrations.hf.VigilCallback`) on GPU 0, through `vigil bench sdk`'s runner (`sdk.pairs`,
`sdk.one_run`): a LocalAgent's relay and a real NATS, as a worker links its ranks.

- overhead: pairs of runs with the SDK and without it (`--no-vigil`), the order flipping every pair;
  `value` is the median step with the callback, `floor` without, `ms_per_step` what Vigil adds to a step
  (negative: within the noise). Reported beside the target, not judged: the CPU figure is `vigil bench sdk`'s.
- a held NaN: a run whose loss is NaN at step NAN_AT (`--nan-rank 0`); the callback drops that step's
  gradients, the run goes on and ends well. What the rank reported through the agent says so: every step
  stored once, NAN_AT's `skipped` with a non-finite loss (its own: `local_finite` false), every other step
  finite and applied, and rank 0's weights finite at the end.

Without CUDA it says `skip`: CI runs the GPU check's CPU half, and this check would add minutes to it.
`VIGIL_GPU_CHECK_HF_ON_CPU=1` runs it on the CPU all the same (one rank, fp32), to prove the path where no
GPU is lent.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import os
import statistics
import time
from typing import Any
from unittest import mock

from vigil.events import StepCompleted
from vigil_bench import result, sdk, servers
from vigil_common import subjects
from vigil_common.bus import Bus
from vigil_common.settings import Settings
from vigil_worker.local import LocalAgent

Result = dict[str, Any]

ON_CPU_ENV = "VIGIL_GPU_CHECK_HF_ON_CPU"
NAN_STEPS, NAN_AT = 12, 5
EVENTS_WAIT_S = 30.0  # for the relay to store the last steps after the rank exited


def hf_trainer_on_device(cuda: bool) -> Result:
    if not cuda and os.environ.get(ON_CPU_ENV) != "1":
        return {
            "status": "skip",
            "reason": f"no CUDA device: `vigil bench sdk` measures the HF Trainer on the CPU ({ON_CPU_ENV}=1 "
            "runs this check here)",
        }
    one_gpu = {"CUDA_VISIBLE_DEVICES": os.environ.get("CUDA_VISIBLE_DEVICES", "0").split(",")[0]}
    # one device: a lone rank of the Trainer would spread over every visible GPU (DataParallel)
    with contextlib.ExitStack() as stack:
        if cuda:
            stack.enter_context(mock.patch.dict(os.environ, one_gpu))
        settings, where = servers(stack, Settings.load(), database=False)
        tmp, url = settings.data_dir, settings.nats_url
        assert url
        agent = stack.enter_context(LocalAgent(url, tmp / "ckpt"))
        on, off = sdk.pairs(tmp, agent, ranks=1)
        nan_args = ["--nan-at", str(NAN_AT), "--nan-rank", "0"]
        out = sdk.one_run(tmp, "nan", nan_args, agent, ranks=1, steps=NAN_STEPS)
        steps = asyncio.run(_steps(url, "nan", agent.node, NAN_STEPS))
    value, floor = statistics.median(on), statistics.median(off)
    overhead = result("sdk", value, floor, "s/step", "<= 1.03")
    problems = _held_problems(steps, out)
    held = {
        "at": NAN_AT,
        "skipped": [e.step for e in steps if e.skipped],
        "finite_weights": out["finite_weights"],
        "steps_stored": len(steps),
    }
    checked: Result = {
        "status": "fail" if problems else "pass",
        **{k: overhead[k] for k in ("value", "floor", "ratio", "unit", "target")},
        "ms_per_step": round((value - floor) * 1e3, 2),
        "steps_measured": len(on),
        "device": "cuda" if cuda else "cpu",
        "held_nan": held,
        "servers": where,
        "config": f"HF Trainer, GPT-2 2 layers x 64, seq 64, micro-batch 8, 1 rank, {sdk.PAIRS} pairs of "
        f"{sdk.STEPS} steps; the NaN at step {NAN_AT} of {NAN_STEPS}",
    }
    if problems:
        checked["problems"] = problems
    return checked


async def _steps(url: str, job_id: str, node: str, n: int) -> list[StepCompleted]:
    """The StepCompleted events stored for `job_id` (waiting up to EVENTS_WAIT_S for `n`), by step."""
    got: list[StepCompleted] = []
    bus = await Bus.connect(url, name="gpu-check-hf")
    try:
        async with bus.watch(subjects.step(job_id, node), from_start=True) as events:
            deadline = time.monotonic() + EVENTS_WAIT_S
            while len(got) < n and (left := deadline - time.monotonic()) > 0:
                event = await events.next(left)
                if isinstance(event, StepCompleted):
                    got.append(event)
    finally:
        await bus.close()
    return sorted(got, key=lambda e: e.step)


def _held_problems(steps: list[StepCompleted], out: dict[str, Any]) -> list[str]:
    """What is wrong with the NaN run, as the rank reported it (none: the NaN was held)."""
    problems = []
    if [e.step for e in steps] != list(range(NAN_STEPS)):
        problems.append(f"steps stored {[e.step for e in steps]}, not each of 0..{NAN_STEPS - 1} once")
    for e in steps:
        faulted = e.step == NAN_AT
        if faulted and not (e.skipped and not math.isfinite(e.loss) and e.local_finite is False):
            problems.append(f"step {e.step}: skipped={e.skipped} loss={e.loss} local_finite={e.local_finite}")
        if not faulted and (e.skipped or not math.isfinite(e.loss)):
            problems.append(f"step {e.step}: skipped={e.skipped} loss={e.loss}")
    if not out["finite_weights"]:
        problems.append("rank 0's weights are not finite at the end")
    return problems
