"""The DeepSpeed config, built by a pure function from the job spec and the hardware.

`build_config(train, world_size=..., n_params=..., hw=...)` returns a `DeepSpeedPlan`: the config dict
DeepSpeed takes, the ZeRO stage and precision chosen, and the reasons for each choice (logged by the
rank, so `zero_stage: auto` is never a mystery). No I/O here: unit tested without DeepSpeed.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from vigil.errors import SpecError
from vigil.spec import CommSpec, TrainSpec

Resolved = Literal["fp32", "bf16", "fp16"]

# Bytes of training state per parameter, (replicated, sharded over the data-parallel ranks), per stage.
# Mixed precision (bf16/fp16): 2 weights + 2 grads + 12 fp32 master weights and Adam moments = 16 per param.
# fp32: 4 weights + 4 grads + 8 Adam moments = 16 per param. ZeRO-1 shards optimizer state, ZeRO-2 also
# gradients, ZeRO-3 also weights (DeepSpeed paper, table 1).
_STATE_BYTES: dict[str, dict[int, tuple[int, int]]] = {
    "mixed": {0: (16, 0), 1: (4, 12), 2: (2, 14), 3: (0, 16)},
    "fp32": {0: (16, 0), 1: (8, 8), 2: (4, 12), 3: (0, 16)},
}
STATE_BUDGET = 0.5  # share of device memory the training state may take; the rest is for activations


@dataclass(frozen=True)
class Hardware:
    """What a rank runs on. `device_memory_bytes` is the memory one rank may use."""

    accelerator: Literal["cpu", "cuda"]
    device_memory_bytes: int
    bf16_supported: bool = False


@dataclass(frozen=True)
class DeepSpeedPlan:
    config: dict[str, Any]
    zero_stage: int
    precision: Resolved
    reasons: tuple[str, ...] = field(default_factory=tuple)
    # DeepSpeed steps the trainer's own AdamW on fp32 weights: ZeRO 0 in fp32, or in bf16 as torch
    # autocast (`autocast`). Then the trainer clips, with the norm its guard computes anyway for the
    # verdict (DeepSpeed's `gradient_clipping` is 0; it checks no norm there).
    owns_step: bool = False
    autocast: bool = False  # the forward runs under torch.autocast(bfloat16); the weights stay fp32


def owns_step(stage: int, precision: str) -> bool:
    """DeepSpeed steps the trainer's own optimizer on fp32 weights: no ZeRO, in fp32 or bf16 autocast."""
    return stage == 0 and precision in ("fp32", "bf16")


def uses_autocast(stage: int, precision: str) -> bool:
    """bf16 without ZeRO runs as torch autocast over fp32 weights (no DeepSpeed BF16_Optimizer)."""
    return stage == 0 and precision == "bf16"


def _bad(fieldname: str, message: str) -> SpecError:
    return SpecError([{"field": fieldname, "message": message}])


def resolve_precision(requested: str, hw: Hardware) -> tuple[Resolved, str]:
    if requested == "auto":
        if hw.accelerator == "cuda" and hw.bf16_supported:
            return "bf16", "precision auto: bf16 (the GPU supports it)"
        if hw.accelerator == "cuda":
            return "fp16", "precision auto: fp16 with dynamic loss scaling (the GPU has no bf16)"
        return "fp32", "precision auto: fp32 (CPU)"
    if requested == "fp16" and hw.accelerator == "cpu":
        raise _bad("train.precision", "fp16 needs a GPU; use fp32 or bf16 on CPU (or precision: auto)")
    if requested == "bf16" and hw.accelerator == "cuda" and not hw.bf16_supported:
        raise _bad("train.precision", "this GPU has no bf16 support; use fp16 or precision: auto")
    return requested, f"precision {requested}: as the spec asks"  # type: ignore[return-value]


def state_bytes_per_rank(n_params: int, world_size: int, stage: int, precision: Resolved) -> int:
    """Estimated bytes of weights, gradients and Adam state one rank holds at a ZeRO stage."""
    replicated, sharded = _STATE_BYTES["fp32" if precision == "fp32" else "mixed"][stage]
    return int(n_params * (replicated + sharded / world_size))


def choose_zero_stage(
    n_params: int, world_size: int, device_memory_bytes: int, precision: Resolved, offload: bool
) -> tuple[int, str]:
    """The lowest ZeRO stage whose training state fits in STATE_BUDGET of device memory.

    Lower stages communicate less, so the lowest one that fits is the fastest. One rank has nothing
    to shard: stage 0. CPU offload needs stage 2 or 3.
    """
    gib = 1024**3
    budget = STATE_BUDGET * device_memory_bytes
    if world_size == 1 and not offload:
        return 0, "zero_stage auto: 0 (one rank: nothing to shard)"
    candidates = (2, 3) if offload else (0, 1, 2, 3)
    for stage in candidates:
        need = state_bytes_per_rank(n_params, world_size, stage, precision)
        if need <= budget:
            tail = ")" if stage == candidates[0] else "; lower stages do not)"
            return stage, (
                f"zero_stage auto: {stage} ({n_params / 1e6:.1f}M params, {world_size} ranks: "
                f"{need / gib:.2f} GiB of state per rank fits in {STATE_BUDGET:.0%} of "
                f"{device_memory_bytes / gib:.1f} GiB{tail}"
            )
    need = state_bytes_per_rank(n_params, world_size, 3, precision)
    return 3, (
        f"zero_stage auto: 3, and it still does not fit ({need / gib:.2f} GiB of state per rank > "
        f"{STATE_BUDGET:.0%} of {device_memory_bytes / gib:.1f} GiB): add ranks or set train.offload: true"
    )


# Gradient buckets: DeepSpeed's default is 5e8 elements, one bucket for any model below 500M parameters,
# so nothing overlaps. Aim for BUCKETS_PER_PASS buckets per backward (reduction of one overlaps the
# backward of the next), but no smaller than MIN_BUCKET (below a few MB a collective is latency-bound).
BUCKETS_PER_PASS = 8
MIN_BUCKET = 2**21  # elements (8 MiB of fp32)
MAX_BUCKET = 5 * 10**8  # DeepSpeed's default


def choose_buckets(
    comm: CommSpec, *, n_params: int, world_size: int, stage: int, hw: Hardware
) -> tuple[dict[str, Any], str]:
    """ZeRO bucket sizes and overlap: the spec's values, or chosen from the model size and hardware."""
    auto = min(MAX_BUCKET, max(MIN_BUCKET, n_params // BUCKETS_PER_PASS))
    reduce = auto if comm.reduce_bucket_size is None else comm.reduce_bucket_size
    gather = auto if comm.allgather_bucket_size is None else comm.allgather_bucket_size
    if comm.overlap_comm is None:
        overlap = hw.accelerator == "cuda" and world_size > 1
        if overlap:
            how = "on (GPU: NCCL runs beside the backward)"
        elif world_size == 1:
            how = "off (one rank: nothing to reduce)"
        else:
            how = "off (CPU: gloo blocks, nothing to overlap)"
    else:
        overlap, how = comm.overlap_comm, "as the spec asks"
    if stage == 0:
        return {}, "buckets: none to tune (no ZeRO: DeepSpeed all-reduces the gradients in fixed buckets)"
    keys = {"reduce_bucket_size": reduce, "overlap_comm": overlap}
    if stage in (1, 2):
        keys["allgather_bucket_size"] = gather
    else:
        keys["stage3_prefetch_bucket_size"] = gather
    rule = (
        f"auto would be {n_params / 1e6:.1f}M params / {BUCKETS_PER_PASS} buckets per pass, within "
        f"[{MIN_BUCKET / 1e6:.1f}M, {MAX_BUCKET / 1e6:.0f}M]: {auto / 1e6:.1f}M"
    )
    why = (
        f"buckets: reduce {reduce / 1e6:.1f}M ({'auto' if comm.reduce_bucket_size is None else 'spec'}), "
        f"all-gather {gather / 1e6:.1f}M ({'auto' if comm.allgather_bucket_size is None else 'spec'}) "
        f"elements ({rule}); overlap_comm {how}"
    )
    return keys, why


def build_config(train: TrainSpec, *, world_size: int, n_params: int, hw: Hardware) -> DeepSpeedPlan:
    """The DeepSpeed config for this job on this hardware.

    Raises SpecError naming a field that cannot work here (fp16 on CPU, offload below stage 2).
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    precision, why_precision = resolve_precision(train.precision, hw)
    if train.zero_stage == "auto":
        stage, why_stage = choose_zero_stage(
            n_params, world_size, hw.device_memory_bytes, precision, train.offload
        )
    else:
        stage, why_stage = int(train.zero_stage), f"zero_stage {train.zero_stage}: as the spec asks"
        if train.offload and stage < 2:
            raise _bad("train.offload", f"CPU offload needs zero_stage 2 or 3 (got {stage})")

    zero: dict[str, Any] = {"stage": stage}
    if stage in (1, 2):
        zero.update(contiguous_gradients=True, reduce_scatter=True)
    if stage == 3:
        zero.update(stage3_gather_16bit_weights_on_model_save=False)
    # without overlap, reductions are synchronous: the comm time we report is the time the step waits
    buckets, why_buckets = choose_buckets(
        train.comm, n_params=n_params, world_size=world_size, stage=stage, hw=hw
    )
    zero.update(buckets)
    if train.offload:
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": hw.accelerator == "cuda"}

    warmup = train.warmup
    config: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": train.micro_batch,
        "gradient_accumulation_steps": train.grad_accum,
        "train_batch_size": train.micro_batch * train.grad_accum * world_size,
        "gradient_clipping": train.grad_clip,
        "zero_optimization": zero,
        # the optimizer is a torch AdamW the rank builds (no DeepSpeed op is compiled on the fly)
        "zero_allow_untested_optimizer": True,
        "zero_force_ds_cpu_optimizer": False,
        "scheduler": {
            "type": "WarmupCosineLR",
            "params": {
                "total_num_steps": train.steps,
                # linear warm-up from lr / warmup (not 0: the first step should learn something)
                "warmup_num_steps": max(1, warmup),
                "warmup_min_ratio": 1.0 / warmup if warmup > 0 else 1.0,
                "warmup_type": "linear",
                "cos_min_ratio": train.min_lr_ratio,
            },
        },
        "steps_per_print": 2**31 - 1,  # Vigil reports progress; DeepSpeed stays quiet
        "wall_clock_breakdown": False,
    }
    owns = owns_step(stage, precision)
    autocast = uses_autocast(stage, precision)
    if owns:
        config["gradient_clipping"] = 0.0  # the trainer clips, with the norm its guard computes anyway
    if autocast:
        # No ZeRO: bf16 as torch autocast over fp32 weights, stepped by the trainer's fused AdamW, as a
        # plain PyTorch loop does. DeepSpeed's BF16_Optimizer would keep a second, flattened fp32 copy and
        # copy gradients in and weights out every step: a fixed cost per step that buys nothing here
        # (the same 16 bytes of state per parameter either way).
        why_precision += "; no ZeRO: torch autocast over fp32 weights (no BF16_Optimizer)"
        # DeepSpeed's own section: its engine.forward turns off an autocast entered outside it
        config["torch_autocast"] = {"enabled": True, "dtype": "bfloat16"}
    elif precision == "bf16":
        # check_grad_overflow: a non-finite gradient makes DeepSpeed skip the step, as in fp32 and fp16
        config["bf16"] = {"enabled": True, "check_grad_overflow": True}
    elif precision == "fp16":
        config["fp16"] = {
            "enabled": True,
            "loss_scale": 0,  # dynamic
            "initial_scale_power": 16,
            "loss_scale_window": 1000,
            "hysteresis": 2,
            "min_loss_scale": 1,
        }
    reasons = (why_precision, why_stage, why_buckets)
    return DeepSpeedPlan(
        config=config,
        zero_stage=stage,
        precision=precision,
        reasons=reasons,
        owns_step=owns,
        autocast=autocast,
    )
