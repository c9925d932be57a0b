"""Every place Vigil reaches into DeepSpeed past its documented API, in one module.

DeepSpeed's internals move between releases (0.16's BF16_Optimizer asserted on the very norm 0.19 reads
as an overflow). Whatever Vigil needs of them is here, each under the name it relies on:

- the torch optimizer DeepSpeed steps, under any wrapper (`engine.basic_optimizer`): Vigil's skip gates
  its `step()` (`vigil.integrations.gate`);
- the engine's record of that step (`engine._step_applied`, `engine.skipped_steps`), the LR scheduler's
  last learning rate (`_last_lr`), and ZeRO's one-time link of its weight fragments to the optimizer
  state (`_hp_optimizer_states_linked`), which a gated first step must not close;
- this rank's shard of a ZeRO-3 parameter (`param.ds_tensor`);
- the backend every ZeRO collective goes through (`deepspeed.comm.comm.cdb`), to time them;
- the shared-memory op DeepSpeed builds on CPU for inference only (`deepspeed.comm.torch.build_shm_op`);
- the classes DeepSpeed's checkpoint files pickle, and the engine's checkpoint reader;
- the engine's backward all-reduce switch (`enable_backward_allreduce`), and a ZeRO optimizer's last
  gradient norm (`_global_grad_norm`, for the Hugging Face callback);
- the engine's state as its checkpoint holds it, in memory (`engine_state`, `load_engine_state`: its
  counters `global_steps`, `global_samples`, and a ZeRO optimizer's `dp_process_group` and
  `elastic_checkpoint`), for in-memory snapshots;
- re-partitioning a ZeRO 1/2 optimizer's state to another data-parallel size (`load_resized_engine_state`,
  `load_resized_checkpoint`): the keys of its checkpoint dict (`deepspeed.checkpoint.constants`), its
  own merge of every former partition (`_restore_elastic_base_optimizer_state`,
  `_restore_from_elastic_fp32_weights`), its global state (`_load_global_state`) and the link of its
  weight fragments (`_link_all_hp_params`); the engine's checkpoint file names
  (`_get_all_zero_checkpoint_names`);
- the modules DeepSpeed imports lazily on a rank's first engine (`LAZY_MODULES`), for a warm rank.

`MODULE_NAMES`, `ENGINE_NAMES` and `PRIVATE_NAMES` list them: tests/unit/sdk/test_ds_compat.py checks that
the installed DeepSpeed has every one, and that no other module of Vigil (or its examples) uses them.
DeepSpeed is imported only inside the functions (DS_ACCELERATOR must be set first on a CPU machine).
"""

from __future__ import annotations

import contextlib
import importlib
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

# (module, attribute) this module imports or patches
MODULE_NAMES: tuple[tuple[str, str], ...] = (
    ("deepspeed.comm.comm", "cdb"),
    ("deepspeed.comm.torch", "build_shm_op"),
    ("deepspeed.runtime.fp16.loss_scaler", "LossScaler"),
    ("deepspeed.runtime.fp16.loss_scaler", "DynamicLossScaler"),
    ("deepspeed.runtime.zero.config", "ZeroStageEnum"),
    ("deepspeed.utils.tensor_fragment", "fragment_address"),
    ("deepspeed.runtime.lr_schedules", "WarmupCosineLR"),
    *(
        ("deepspeed.checkpoint.constants", name)
        for name in (
            "BASE_OPTIMIZER_STATE",
            "BASE_OPTIMIZER_STATE_STEP",
            "GROUP_PADDINGS",
            "OPTIMIZER_STATE_DICT",
        )
    ),
    *(("deepspeed.utils.groups", name) for name in ("_WORLD_GROUP", "_DATA_PARALLEL_GROUP", "mesh_device")),
)
# attributes of a DeepSpeedEngine this module reads or writes (besides its documented methods)
ENGINE_NAMES: tuple[str, ...] = (
    "basic_optimizer",
    "_step_applied",
    "skipped_steps",
    "enable_backward_allreduce",
    "checkpoint_engine",
    "lr_scheduler",
    "global_steps",
    "global_samples",
    "zero_load_from_fp32_weights",
    "_get_all_zero_checkpoint_names",
    "dp_world_size",
)
# every private (or internal) DeepSpeed name used here; no other module of Vigil may use one
PRIVATE_NAMES: tuple[str, ...] = (
    "basic_optimizer",
    "_step_applied",
    "skipped_steps",
    "_hp_optimizer_states_linked",
    "_last_lr",
    "ds_tensor",
    "enable_backward_allreduce",
    "checkpoint_engine",
    "cdb",
    "build_shm_op",
    "_global_grad_norm",
    "global_steps",
    "global_samples",
    "dp_process_group",
    "elastic_checkpoint",
    "_restore_elastic_base_optimizer_state",
    "_restore_from_elastic_fp32_weights",
    "_load_global_state",
    "_link_all_hp_params",
    "_get_all_zero_checkpoint_names",
    "_WORLD_GROUP",
    "_DATA_PARALLEL_GROUP",
    "_MODEL_PARALLEL_GROUP",
    "_ZERO_PARAM_INTRA_PARALLEL_GROUP",
    "_EXPERT_PARALLEL_GROUP",
    "_EXPERT_DATA_PARALLEL_GROUP",
    "_ALL_TO_ALL_GROUP",
)


# --- the step -----------------------------------------------------------------------------------------


def client_optimizer(engine: Any) -> torch.optim.Optimizer:
    """The torch optimizer DeepSpeed steps: the program's own (or the one the config names), under ZeRO's,
    BF16_Optimizer's or FP16_Optimizer's wrapper, or the engine's optimizer itself without one."""
    opt = engine.basic_optimizer
    if not isinstance(opt, torch.optim.Optimizer):
        raise TypeError(f"vigil: DeepSpeed steps a {type(opt).__name__}, not a torch optimizer")
    return opt


@dataclass(frozen=True)
class StepRecord:
    """What a step leaves in the engine and its LR scheduler, taken before it to undo it after."""

    lrs: tuple[float, ...]  # each param group's learning rate
    scheduler: dict[str, Any] | None  # the scheduler's state_dict
    last_lr: Any  # the scheduler's last computed learning rates (not in every state_dict)
    linked: bool | None  # ZeRO's fragments linked to the optimizer state yet (None: no such link)


def record(engine: Any) -> StepRecord:
    sched = engine.lr_scheduler
    last = getattr(sched, "_last_lr", None)
    return StepRecord(
        lrs=tuple(float(g["lr"]) for g in engine.optimizer.param_groups),
        scheduler=sched.state_dict() if sched is not None else None,
        last_lr=list(last) if isinstance(last, list) else last,
        linked=getattr(engine.optimizer, "_hp_optimizer_states_linked", None),
    )


def undo_step(engine: Any, before: StepRecord, *, counted: bool) -> None:
    """After an `engine.step()` whose update was dropped: the LR schedule back where it was, the step
    recorded as skipped (`was_step_applied()` False), and, where DeepSpeed itself did not see it as
    skipped (`counted` False), counted in `engine.skipped_steps` as its own skips are."""
    sched = engine.lr_scheduler
    if sched is not None and before.scheduler is not None:
        sched.load_state_dict(before.scheduler)
        if before.last_lr is not None:
            sched._last_lr = before.last_lr
    for group, lr in zip(engine.optimizer.param_groups, before.lrs, strict=True):
        group["lr"] = lr
    if before.linked is False:  # the gated step opened no optimizer state for the link to see
        engine.optimizer._hp_optimizer_states_linked = False
    if not counted:
        engine._step_applied = False
        engine.skipped_steps += 1


def local_shards(engine: Any) -> list[torch.Tensor]:
    """The parameter data this rank holds: the whole tensor, or its shard under ZeRO 3."""
    out = []
    for p in engine.module.parameters():
        t = getattr(p, "ds_tensor", None)
        out.append(p.data if t is None else t.data)
    return out


# --- setup ----------------------------------------------------------------------------------------------


def skip_shm_build() -> None:
    """DeepSpeed's shared-memory op serves inference all-reduces only: skip its JIT build on a CPU (call
    before `deepspeed.init_distributed`)."""
    importlib.import_module("deepspeed.comm.torch").build_shm_op = lambda: None


# Modules DeepSpeed imports lazily on a rank's first engine: ZeRO's optimizer check imports its Muon
# optimizer, which torch.compiles at import (inductor: seconds on a CPU). A warm rank imports them early.
LAZY_MODULES: tuple[str, ...] = ("deepspeed.runtime.zero.muon.muon_optimizer",)


def import_lazy_modules() -> None:
    """Import what DeepSpeed would import on the first engine (`LAZY_MODULES`, those that exist)."""
    for name in LAZY_MODULES:
        with contextlib.suppress(ImportError):
            importlib.import_module(name)


def zero_grad_norm(optimizer: Any) -> float | None:
    """The gradients' global norm, before clipping, that a ZeRO optimizer computed for its last step (the
    optimizer the Hugging Face Trainer hands its callbacks wraps it as `.optimizer`); None elsewhere."""
    inner = getattr(optimizer, "optimizer", optimizer)
    norm = getattr(inner, "_global_grad_norm", None)
    return float(norm) if norm is not None else None


def no_backward_allreduce(engine: Any) -> None:
    """One rank has nothing to reduce: DeepSpeed would still flatten every gradient, all-reduce it over a
    group of one and copy it back each step (its own switch, which pipeline engines turn off too)."""
    engine.enable_backward_allreduce = False


def comm_backend() -> Any:
    """The backend through which ZeRO issues every collective (after `deepspeed.init_distributed`)."""
    from deepspeed.comm import comm as ds_comm

    backend = ds_comm.cdb
    if backend is None:
        raise RuntimeError("vigil: DeepSpeed's comm backend needs deepspeed.init_distributed() first")
    return backend


def forget_groups() -> None:
    """After `torch.distributed.destroy_process_group()` in a process that goes on (a rank that waits for
    its job's next attempt, `vigil_trainer.park`): DeepSpeed's comm backend and its cached groups
    name the destroyed group. Dropped, the next `deepspeed.init_distributed` and engine make new ones."""
    from deepspeed.comm import comm as ds_comm
    from deepspeed.utils import groups

    ds_comm.cdb = None
    cached = ("_WORLD_GROUP", "_DATA_PARALLEL_GROUP", "_MODEL_PARALLEL_GROUP")
    cached += ("_ZERO_PARAM_INTRA_PARALLEL_GROUP",)
    for name in (*cached, "mesh_device", "mpu"):
        if hasattr(groups, name):
            setattr(groups, name, None)
    for name in ("_EXPERT_PARALLEL_GROUP", "_EXPERT_DATA_PARALLEL_GROUP", "_ALL_TO_ALL_GROUP"):
        if isinstance(by_key := getattr(groups, name, None), dict):
            by_key.clear()


# --- checkpoints ----------------------------------------------------------------------------------------


def checkpoint_safe_globals() -> list[Any]:
    """The few DeepSpeed classes its checkpoint files pickle besides tensors and plain containers."""
    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler, LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum
    from deepspeed.utils.tensor_fragment import fragment_address

    return [ZeroStageEnum, LossScaler, DynamicLossScaler, fragment_address]


def read_checkpoints_with(engine: Any, load: Callable[[str, Any], Any]) -> None:
    """Make the engine read its checkpoint files with `load(path, map_location)`."""
    engine.checkpoint_engine.load = load


# --- in-memory snapshots --------------------------------------------------------------------------------


def engine_state(engine: Any) -> dict[str, Any]:
    """This rank's part of the engine's state, as DeepSpeed's checkpoint of it holds it (the module, the
    optimizer: a ZeRO optimizer's partition, the LR scheduler, the step counters): references to the live
    tensors, for `vigil.snapshot.to_host` to copy. Not for ZeRO-3 (its module is partitioned)."""
    if engine.zero_optimization_stage() == 3:
        raise NotImplementedError("in-memory snapshots of a ZeRO-3 engine")
    return {
        "module": engine.module.state_dict(),
        "optimizer": engine.optimizer.state_dict() if engine.optimizer is not None else None,
        "lr_scheduler": engine.lr_scheduler.state_dict() if engine.lr_scheduler is not None else None,
        "global_steps": engine.global_steps,
        "global_samples": engine.global_samples,
        "skipped_steps": engine.skipped_steps,
    }


def load_engine_state(engine: Any, state: dict[str, Any], former: list[Any] | None = None) -> None:
    """Load what `engine_state` returned into the running engine, as its `load_checkpoint` loads a
    checkpoint (the module, then the optimizer from its fp32 partition, the scheduler, the counters).
    `former`: every former rank's ZeRO optimizer state of a job that changed its size, re-partitioned to
    this engine's (`resize_optimizer`) instead of `state`'s own partition. The optimizer keeps the tensors
    it is given (torch's `load_state_dict` does not copy them): pass a state nobody else holds."""
    import torch.distributed as dist

    engine.module.load_state_dict(state["module"], strict=True)
    opt = engine.optimizer
    if opt is not None and state["optimizer"] is not None:
        if engine.zero_optimization() and former is not None:
            resize_optimizer(engine, former)
        elif engine.zero_optimization():
            if opt.elastic_checkpoint:
                raise NotImplementedError("in-memory snapshots of a ZeRO optimizer with elastic_checkpoint")
            shards: list[Any] = [None] * dist.get_world_size(group=opt.dp_process_group)
            shards[dist.get_rank(group=opt.dp_process_group)] = state["optimizer"]  # it reads its own only
            fp32 = engine.zero_load_from_fp32_weights()
            opt.load_state_dict(shards, load_optimizer_states=True, load_from_fp32_weights=fp32)
        elif engine.fp16_enabled() or engine.bfloat16_enabled():
            opt.load_state_dict(state["optimizer"], load_optimizer_states=True)
        else:
            opt.load_state_dict(state["optimizer"])
    if engine.lr_scheduler is not None and state["lr_scheduler"] is not None:
        engine.lr_scheduler.load_state_dict(state["lr_scheduler"])
    engine.global_steps = state["global_steps"]
    engine.global_samples = state["global_samples"]
    engine.skipped_steps = state["skipped_steps"]


# --- another data-parallel size (elastic) -----------------------------------------------------------------


def load_resized_engine_state(engine: Any, states: list[dict[str, Any]], rank: int) -> None:
    """Load every former rank's `engine_state` (a job that shrank or grew: `states[r]` is former rank r's)
    into this rank's engine at its present size: the module and counters as any rank had them (they are
    the same on every rank under ZeRO 1 and 2), and the optimizer re-partitioned to the present
    data-parallel size (`resize_optimizer`); without ZeRO every rank's optimizer is whole: former rank
    `rank % len(states)`'s is loaded."""
    if engine.zero_optimization_stage() == 3:
        raise NotImplementedError(
            "re-partitioning a ZeRO-3 engine's state (in-memory snapshots are off there)"
        )
    load_engine_state(engine, states[rank % len(states)], former=[s["optimizer"] for s in states])


def resize_optimizer(engine: Any, former: list[dict[str, Any]]) -> None:
    """A ZeRO 1/2 optimizer's state from every former partition (`former[r]`: its `state_dict()` on former
    rank r, at any data-parallel size), re-partitioned to this engine's: the fp32 master weights and each
    optimizer state tensor (Adam's `exp_avg`, `exp_avg_sq`) are joined without their padding and cut
    again for the present size by DeepSpeed's own elastic-checkpoint code; the step count, the loss scaler
    and the param groups' hyperparameters (the learning rate the schedule set) are the same on every former
    rank. The optimizer keeps tensors it is given: pass copies."""
    from deepspeed.checkpoint.constants import BASE_OPTIMIZER_STATE, BASE_OPTIMIZER_STATE_STEP, GROUP_PADDINGS

    opt = engine.optimizer
    lean = [
        _elastic_form(sd, BASE_OPTIMIZER_STATE, BASE_OPTIMIZER_STATE_STEP, GROUP_PADDINGS) for sd in former
    ]
    opt._load_global_state(lean[0])
    opt._restore_elastic_base_optimizer_state(lean)
    if engine.zero_load_from_fp32_weights():
        opt._restore_from_elastic_fp32_weights(lean)
    else:
        opt.refresh_fp32_params()
    opt._link_all_hp_params()
    base = former[0][BASE_OPTIMIZER_STATE]
    if isinstance(base, dict):  # the elastic merge sets no hyperparameter: the learning rate, as saved
        for group, saved in zip(opt.optimizer.param_groups, base["param_groups"], strict=True):
            group.update({k: v for k, v in saved.items() if k != "params"})


def _elastic_form(sd: dict[str, Any], base_key: str, step_key: str, paddings_key: str) -> dict[str, Any]:
    """A ZeRO 1/2 optimizer's `state_dict()` as DeepSpeed writes it with `elastic_checkpoint`: the base
    optimizer's state per param group (one flat partition each) without the partition's padding, and the
    step count apart. Already in that form (a list), it is returned as it is."""
    base = sd[base_key]
    if not isinstance(base, dict):
        return sd
    groups, steps = [], set()
    for i, group in enumerate(base["param_groups"]):
        (pid,) = group["params"]  # ZeRO 1/2 hand the optimizer one flat partition per group
        padding = sd[paddings_key][i] if sd.get(paddings_key) else 0
        state = {}
        for key, value in base["state"].get(pid, {}).items():
            if torch.is_tensor(value) and value.dim() > 0:
                value = value[: value.numel() - padding]
            elif key == "step":
                steps.add(float(value))
            state[key] = value
        groups.append(state)
    if len(steps) > 1:
        raise ValueError(
            f"vigil: the param groups' optimizer steps differ ({sorted(steps)}): cannot re-partition"
        )
    return {
        **sd,
        base_key: groups,
        step_key: steps.pop() if steps else base["param_groups"][0].get("step", 0),
    }


def saved_at_another_size(engine: Any, path: str, tag: str) -> int | None:
    """The data-parallel size a ZeRO checkpoint folder was saved at (how many optimizer partition files,
    `*zero_pp_rank_<r>_mp_rank_00_optim_states.pt`, it holds) where it is not this engine's; None: the
    same size, or no ZeRO partitions."""
    from pathlib import Path

    saved = len(list((Path(path) / tag).glob("*zero_pp_rank_*_mp_rank_00_optim_states.pt")))
    return saved if saved and saved != engine.dp_world_size else None


def load_resized_checkpoint(engine: Any, path: str, tag: str) -> None:
    """Load a DeepSpeed checkpoint folder saved at another data-parallel size (a ZeRO 1/2 job that shrank
    or grew): the module, LR scheduler and counters through the engine's loader without the optimizer
    (it refuses a ZeRO optimizer state of another size), then every former partition's file re-partitioned
    to this engine's (`resize_optimizer`)."""
    from deepspeed.checkpoint.constants import OPTIMIZER_STATE_DICT

    loaded, _ = engine.load_checkpoint(
        path, tag=tag, load_optimizer_states=False, load_lr_scheduler_states=True
    )
    if loaded is None:
        raise RuntimeError(f"DeepSpeed could not load {path}")
    if not engine.zero_optimization() or engine.optimizer is None:
        return
    names = engine._get_all_zero_checkpoint_names(path, tag, engine.bfloat16_enabled())
    if not all(os.path.exists(name) for name in names):  # saved with the other precision's file names
        names = engine._get_all_zero_checkpoint_names(path, tag, not engine.bfloat16_enabled())
    former = [engine.checkpoint_engine.load(name, map_location="cpu")[OPTIMIZER_STATE_DICT] for name in names]
    resize_optimizer(engine, former)
