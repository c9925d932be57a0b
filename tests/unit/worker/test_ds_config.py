import pytest

from vigil.errors import SpecError
from vigil.spec import TrainSpec
from vigil_trainer.ds_config import (
    Hardware,
    build_config,
    choose_zero_stage,
    resolve_precision,
    state_bytes_per_rank,
)

GIB = 1024**3
CPU = Hardware("cpu", 8 * GIB)
A100 = Hardware("cuda", 80 * GIB, bf16_supported=True)
V100 = Hardware("cuda", 32 * GIB, bf16_supported=False)


def test_batch_sizes_accumulation_and_clipping():
    plan = build_config(
        TrainSpec(micro_batch=4, grad_accum=3, grad_clip=0.5), world_size=2, n_params=10**6, hw=CPU
    )
    c = plan.config
    assert c["train_micro_batch_size_per_gpu"] == 4
    assert c["gradient_accumulation_steps"] == 3
    assert c["train_batch_size"] == 4 * 3 * 2
    # no ZeRO in fp32: DeepSpeed steps the trainer's optimizer, and the trainer clips (with its guard's norm)
    assert plan.zero_stage == 0 and plan.owns_step and not plan.autocast
    assert c["gradient_clipping"] == 0.0
    zero1 = build_config(
        TrainSpec(micro_batch=4, grad_clip=0.5, zero_stage=1), world_size=2, n_params=10**6, hw=CPU
    )
    assert zero1.config["gradient_clipping"] == 0.5 and not zero1.owns_step


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_explicit_zero_stage_is_kept(stage):
    plan = build_config(TrainSpec(zero_stage=stage), world_size=2, n_params=10**6, hw=CPU)
    assert plan.zero_stage == stage == plan.config["zero_optimization"]["stage"]
    assert "as the spec asks" in plan.reasons[1]


def test_precision_auto():
    assert resolve_precision("auto", CPU)[0] == "fp32"
    assert resolve_precision("auto", A100)[0] == "bf16"
    assert resolve_precision("auto", V100)[0] == "fp16"


def test_precision_sections():
    # one rank, no ZeRO: bf16 is torch autocast over fp32 weights (DeepSpeed's BF16_Optimizer not used)
    one = build_config(TrainSpec(), world_size=1, n_params=10**6, hw=A100)
    assert one.zero_stage == 0 and one.precision == "bf16" and one.autocast and one.owns_step
    assert "bf16" not in one.config and "fp16" not in one.config and one.config["gradient_clipping"] == 0.0
    # DeepSpeed's own section: its engine.forward turns an autocast entered outside it off
    assert one.config["torch_autocast"] == {"enabled": True, "dtype": "bfloat16"}
    assert "torch autocast" in one.reasons[0]
    bf16 = build_config(TrainSpec(zero_stage=1), world_size=2, n_params=10**6, hw=A100).config
    assert bf16["bf16"] == {"enabled": True, "check_grad_overflow": True} and "fp16" not in bf16
    fp16 = build_config(TrainSpec(precision="fp16"), world_size=1, n_params=10**6, hw=V100).config
    assert fp16["fp16"]["enabled"] and fp16["fp16"]["loss_scale"] == 0  # dynamic loss scaling
    fp32 = build_config(TrainSpec(), world_size=1, n_params=10**6, hw=CPU).config
    assert "bf16" not in fp32 and "fp16" not in fp32


def test_impossible_precision_names_the_field():
    with pytest.raises(SpecError, match=r"train\.precision"):
        build_config(TrainSpec(precision="fp16"), world_size=1, n_params=1, hw=CPU)
    with pytest.raises(SpecError, match=r"train\.precision"):
        build_config(TrainSpec(precision="bf16"), world_size=1, n_params=1, hw=V100)


def test_warmup_cosine_schedule():
    sched = build_config(
        TrainSpec(steps=1000, warmup_steps=50, min_lr_ratio=0.1), world_size=1, n_params=1, hw=CPU
    )
    p = sched.config["scheduler"]["params"]
    assert sched.config["scheduler"]["type"] == "WarmupCosineLR"
    assert p == {
        "total_num_steps": 1000,
        "warmup_num_steps": 50,
        "warmup_min_ratio": 1 / 50,
        "warmup_type": "linear",
        "cos_min_ratio": 0.1,
    }
    no_warmup = build_config(TrainSpec(warmup_steps=0), world_size=1, n_params=1, hw=CPU)
    assert no_warmup.config["scheduler"]["params"]["warmup_min_ratio"] == 1.0


def test_offload():
    plan = build_config(TrainSpec(zero_stage=2, offload=True), world_size=2, n_params=10**6, hw=A100)
    assert plan.config["zero_optimization"]["offload_optimizer"] == {"device": "cpu", "pin_memory": True}
    with pytest.raises(SpecError, match=r"train\.offload"):
        build_config(TrainSpec(zero_stage=1, offload=True), world_size=2, n_params=1, hw=A100)
    auto = build_config(TrainSpec(offload=True), world_size=1, n_params=10**6, hw=A100)
    assert auto.zero_stage == 2


def test_auto_one_rank_is_stage_0():
    stage, why = choose_zero_stage(7 * 10**9, 1, 80 * GIB, "bf16", offload=False)
    assert stage == 0 and "one rank" in why


def test_auto_small_model_fits_unsharded():
    stage, why = choose_zero_stage(124 * 10**6, 8, 80 * GIB, "bf16", offload=False)
    assert stage == 0 and "fits" in why


def test_auto_picks_the_lowest_stage_that_fits():
    # 7B bf16 on 8 x 80 GiB (budget 40 GiB): ZeRO-1 holds 4 + 12/8 bytes/param = 35.9 GiB
    stage, why = choose_zero_stage(7 * 10**9, 8, 80 * GIB, "bf16", offload=False)
    assert stage == 1, why
    assert state_bytes_per_rank(7 * 10**9, 8, 0, "bf16") > 40 * GIB
    # 1.1B on 4 x 12 GiB (budget 6 GiB): ZeRO-1 needs 7.2 GiB, ZeRO-2 5.6 GiB
    stage, why = choose_zero_stage(1_100_000_000, 4, 12 * GIB, "bf16", offload=False)
    assert stage == 2 and "lower stages do not" in why
    # 7B on 8 x 24 GiB: even ZeRO-3 (13 GiB) exceeds the 12 GiB budget -> 3, with advice
    stage, why = choose_zero_stage(7 * 10**9, 8, 24 * GIB, "bf16", offload=False)
    assert stage == 3 and "offload" in why


def test_buckets_auto_from_model_size_with_the_reason():
    small = build_config(TrainSpec(zero_stage=2), world_size=2, n_params=124 * 10**6, hw=A100)
    z = small.config["zero_optimization"]
    assert z["reduce_bucket_size"] == z["allgather_bucket_size"] == 124 * 10**6 // 8
    assert z["overlap_comm"] is True  # GPUs: NCCL runs beside the backward
    assert "buckets: reduce 15.5M" in small.reasons[2] and "overlap_comm on" in small.reasons[2]
    tiny = build_config(TrainSpec(zero_stage=1), world_size=2, n_params=10**6, hw=CPU)
    z = tiny.config["zero_optimization"]
    assert z["reduce_bucket_size"] == 2**21 and z["overlap_comm"] is False  # floor; gloo blocks anyway
    huge = build_config(TrainSpec(zero_stage=3), world_size=8, n_params=70 * 10**9, hw=A100)
    z = huge.config["zero_optimization"]
    assert z["reduce_bucket_size"] == z["stage3_prefetch_bucket_size"] == 5 * 10**8  # DeepSpeed's default cap


def test_buckets_from_the_spec_and_none_without_zero():
    spec = TrainSpec(
        zero_stage=2,
        comm={"reduce_bucket_size": 2**20, "allgather_bucket_size": 2**22, "overlap_comm": False},
    )
    plan = build_config(spec, world_size=2, n_params=10**9, hw=A100)
    z = plan.config["zero_optimization"]
    assert (z["reduce_bucket_size"], z["allgather_bucket_size"], z["overlap_comm"]) == (2**20, 2**22, False)
    plan0 = build_config(TrainSpec(zero_stage=0), world_size=2, n_params=10**9, hw=A100)
    assert set(plan0.config["zero_optimization"]) == {"stage"} and "no ZeRO" in plan0.reasons[2]
