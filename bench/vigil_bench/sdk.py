"""`vigil bench sdk`: what the rank SDK costs a program that brings its own training code.

The same Hugging Face Trainer script (examples/byo/hf_trainer.py: a 2-layer GPT-2, two ranks, DDP on
gloo, CPU) runs with `vigil.integrations.hf.VigilCallback` linked to an agent's relay and a real NATS
(the step boundary's all-reduce, the gradient norm, a StepCompleted per rank per step) and without it
(`--no-vigil`, no agent). Runs alternate, the order flipping every pair, so drift on a shared machine
hits both alike. Rank 0 of each run times every step (start of one step to the start of the next, every
callback included) after a warm-up; `value` is the median of all such steps with the callback, `floor`
without, and `ms_per_step` their difference: the milliseconds Vigil adds to a step (negative: within the
noise). Target: ratio <= 1.03.

`python -m vigil_bench.sdk SCRIPT ARGS...` runs SCRIPT as `__main__` (how the ranks start it).
"""

from __future__ import annotations

import contextlib
import json
import runpy
import statistics
import sys
from pathlib import Path
from typing import Any

from vigil_bench import result, servers
from vigil_common.settings import Settings
from vigil_worker.local import LocalAgent, start_ranks

SCRIPT = Path(__file__).resolve().parents[2] / "examples" / "byo" / "hf_trainer.py"
PAIRS = 3
STEPS = 60
ARGS = ["--save-every", "1000000", "--micro-batch", "8", "--seq-len", "64"]


def one_run(
    tmp: Path, name: str, extra: list[str], agent: LocalAgent | None, *, ranks: int = 2, steps: int = STEPS
) -> dict[str, Any]:
    """One run of SCRIPT on `ranks` ranks (with `agent`: under the SDK, as job `name`); rank 0's last line
    (the steps trained, whether its weights are finite, its step times)."""
    run_dir = tmp / name
    args = [str(SCRIPT), *ARGS, "--steps", str(steps), "--out", str(run_dir / "out"), *extra]
    started = start_ranks(
        args,
        ranks,
        run_dir,
        module="vigil_bench.sdk",
        agent=agent,
        job=(name, 1) if agent is not None else None,
    )
    try:
        codes = started.wait(600)
    finally:
        started.kill()
    log = (run_dir / "rank-0.log").read_text()
    if codes != [0] * ranks:
        raise RuntimeError(f"bench run {name} failed: exit codes {codes}\n{started.tail()}")
    out = json.loads([line for line in log.splitlines() if line.startswith("{")][-1])
    if out["steps"] != steps or not out["step_s"]:
        raise RuntimeError(f"bench run {name}: {out}")
    return out


def pairs(tmp: Path, agent: LocalAgent, *, ranks: int = 2, n: int = PAIRS) -> tuple[list[float], list[float]]:
    """`n` pairs of runs, with the SDK and without (`--no-vigil`), the order flipping every pair; rank 0's
    step times (on, off)."""
    on: list[float] = []
    off: list[float] = []
    for i in range(n):  # off, on / on, off / ...: neither side always runs first
        for side in ("off", "on") if i % 2 == 0 else ("on", "off"):
            if side == "off":
                off += one_run(tmp, f"off-{i}", ["--no-vigil"], None, ranks=ranks)["step_s"]
            else:
                on += one_run(tmp, f"on-{i}", [], agent, ranks=ranks)["step_s"]
    return on, off


def run(settings: Settings) -> dict[str, object]:
    if not SCRIPT.is_file():
        raise RuntimeError(f"{SCRIPT} is missing: run `vigil bench sdk` from a checkout of the repository")
    with contextlib.ExitStack() as stack:
        settings, where = servers(stack, settings, database=False)
        tmp, url = settings.data_dir, settings.nats_url
        assert url
        agent = stack.enter_context(LocalAgent(url, tmp / "ckpt"))
        on, off = pairs(tmp, agent)
    value, floor = statistics.median(on), statistics.median(off)
    return result(
        "sdk",
        value,
        floor,
        "s/step",
        "<= 1.03",
        ms_per_step=round((value - floor) * 1e3, 2),
        steps_measured=len(on),
        mean_on_s=round(statistics.fmean(on), 6),
        mean_off_s=round(statistics.fmean(off), 6),
        servers=where,
        config=f"HF Trainer, GPT-2 2 layers x 64, seq 64, micro-batch 8, 2 ranks DDP gloo CPU, {STEPS} steps",
    )


if __name__ == "__main__":
    script, *rest = sys.argv[1:]
    sys.argv = [script, *rest]
    sys.path.insert(0, str(Path(script).resolve().parent))
    runpy.run_path(script, run_name="__main__")
