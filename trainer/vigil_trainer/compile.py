"""`train.compile`: whether the trainer compiles its model with `torch.compile`, and the one call that does.

`auto` compiles on a GPU and not on a CPU: inductor's CPU kernels gain little on the small models a CPU
trains, and the compile (tens of seconds) would dwarf a short CPU run. The module is compiled in place
through DeepSpeed's own `engine.compile()` (`nn.Module.compile` under it), after `deepspeed.initialize`:
the parameters keep their names (`state_dict` keys carry no `_orig_mod.`), so checkpoints are the same
with compile on or off, and a load copies into the same tensors, which no guard of the compiled graph
watches (no recompile after a rollback). A smaller micro-batch after an out-of-memory is one recompile,
dynamic in the batch dimension from then on.
"""

from __future__ import annotations

import logging
import time
from typing import Any, Literal

import torch

log = logging.getLogger("vigil.rank")

CompileSetting = bool | Literal["auto"]


def should_compile(setting: CompileSetting, device: torch.device, zero_stage: int = 0) -> bool:
    """`train.compile` resolved: auto means on for a GPU below ZeRO 3, off for a CPU. Under ZeRO 3 every
    parameter gather is a graph break (15 graphs for a 2-layer model, not 1), so auto leaves it eager;
    `true` compiles it all the same."""
    if setting == "auto":
        return device.type == "cuda" and zero_stage < 3
    return bool(setting)


def compile_engine(engine: Any, setting: CompileSetting, device: torch.device, zero_stage: int = 0) -> bool:
    """Compile the engine's module where `train.compile` says so (DeepSpeed's `engine.compile()`, inductor);
    returns whether it did. The compile itself runs lazily, at the first forward and backward."""
    if not should_compile(setting, device, zero_stage):
        if setting == "auto" and device.type == "cuda":
            log.info("torch.compile: off (train.compile auto, ZeRO 3: a graph break at every gather)")
        return False
    t0 = time.perf_counter()
    engine.compile(backend="inductor")
    log.info("torch.compile: on (train.compile %s), inductor; graphs build at the first step", setting)
    log.debug("engine.compile took %.3f s", time.perf_counter() - t0)
    return True


def compiled_graphs() -> int:
    """Graphs torch.compile has built in this process so far (a recompile builds one more)."""
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])
