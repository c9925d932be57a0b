"""One rank of the skip test (tests/integration/worker/test_skip.py): the trainer's own engine
(`rank.build_engine`, its DeepSpeed config) in each ZeRO stage and precision, a step applied, a held
(finite) step and a NaN step dropped by `skip_step`, then a step applied again. Writes what it saw to
<out>/<case>-rank<r>.json: whether the weights this rank holds, its optimizer state and the LR schedule
stayed as they were, and the time of a plain step, of a skipped one and of the check alone."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any

import torch

from vigil.integrations import ds_compat
from vigil.integrations.deepspeed import skip_step
from vigil.integrations.gate import Sample
from vigil.spec import parse_spec
from vigil_trainer.rank import build_engine, init_process_group, rank_env

CASES = [(0, "fp32"), (0, "bf16"), (1, "fp32"), (1, "bf16"), (2, "fp32"), (3, "fp32"), (3, "bf16")]


def state(engine: Any) -> dict[str, Any]:
    opt = ds_compat.client_optimizer(engine)
    return {
        "weights": [t.detach().clone() for t in ds_compat.local_shards(engine)],
        "moments": [t.clone() for s in opt.state.values() for t in s.values() if torch.is_tensor(t)],
        "iteration": engine.lr_scheduler.last_batch_iteration,
        "lr": engine.get_lr(),
    }


def same(a: dict[str, Any], b: dict[str, Any]) -> dict[str, bool]:
    def equal(x: list[torch.Tensor], y: list[torch.Tensor]) -> bool:
        return len(x) == len(y) and all(torch.equal(s, t) for s, t in zip(x, y, strict=True))

    return {
        "weights": equal(a["weights"], b["weights"]),
        "moments": equal(a["moments"], b["moments"]),
        "lr": a["iteration"] == b["iteration"] and a["lr"] == b["lr"],
    }


def one_step(engine: Any, rank: int, factor: float, skip: bool) -> float:
    """The micro-steps of one step, then its boundary: `engine.step()`, or `skip_step`; the boundary's s."""
    g = torch.Generator().manual_seed(1000 * engine.global_steps + rank)
    accum = engine.gradient_accumulation_steps()
    for micro in range(accum):
        x = torch.randint(0, 256, (2, 16), generator=g)
        loss = engine(x, torch.roll(x, -1, 1)) * factor
        engine.backward(loss)
        if micro < accum - 1:
            engine.step()
    t0 = time.perf_counter()
    if skip:
        skip_step(engine)
    else:
        engine.step()
    return time.perf_counter() - t0


def case(stage: int, precision: str, env: Any, device: torch.device) -> dict[str, Any]:
    spec = parse_spec(
        {
            "name": "skip",
            "resources": {"gpus_per_node": 1},
            "model": {"preset": "tiny", "n_layer": 2, "seq_len": 16},
            "train": {"steps": 20, "micro_batch": 2, "grad_accum": 2, "warmup_steps": 5, "lr": 3e-3,
                      "zero_stage": stage, "precision": precision},
        }
    )  # fmt: skip
    engine, _ = build_engine(spec, env, device)
    out: dict[str, Any] = {}
    plain = [one_step(engine, env.rank, 1.0, skip=False) for _ in range(2)]
    before = state(engine)
    out["held_s"] = one_step(engine, env.rank, 50.0, skip=True)  # a finite spike, held
    out["held"] = same(before, state(engine)) | {"applied": engine.was_step_applied()}
    out["nan_s"] = one_step(engine, env.rank, float("nan"), skip=True)
    out["nan"] = same(before, state(engine)) | {"applied": engine.was_step_applied()}
    out["skipped_steps"] = engine.skipped_steps
    plain.append(one_step(engine, env.rank, 1.0, skip=False))
    after = state(engine)
    out["next"] = same(before, after) | {"applied": engine.was_step_applied()}
    out["next_iteration"] = after["iteration"] - before["iteration"]
    out["finite"] = all(bool(torch.isfinite(t).all()) for t in after["weights"])
    out["plain_s"] = sorted(plain)[1]
    t0 = time.perf_counter()
    for _ in range(20):
        Sample(ds_compat.local_shards(engine)).unchanged()
    out["check_s"] = (time.perf_counter() - t0) / 20
    return out


def main() -> None:
    out = Path(sys.argv[1])
    env = rank_env()
    device = init_process_group(env)
    for stage, precision in CASES:
        name = f"zero{stage}-{precision}"
        try:
            got = case(stage, precision, env, device)
        except Exception as exc:  # one case's failure is its test's, not the others'
            got = {"error": f"{type(exc).__name__}: {exc}"}
        (out / f"{name}-rank{env.rank}.json").write_text(json.dumps(got))
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
