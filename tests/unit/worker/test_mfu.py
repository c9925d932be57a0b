"""FLOPs per token (PaLM's 6N + 12·L·d·T) against hand-computed values, and the peak table."""

from __future__ import annotations

import pytest
import torch

from vigil.spec import PRESETS, ModelSpec, MoESpec
from vigil_trainer.mfu import Peak, flops_per_token, mfu, peak_flops, table_peak
from vigil_trainer.model import GPT

# Worked by hand from the presets (d = d_model, hd = d / n_head, f = SwiGLU width, V = vocab, T = seq_len):
#   per layer: q, o = 2·d·(n_head·hd); k, v = 2·d·(n_kv·hd); SwiGLU 3·d·f.  N = L·(attn + mlp) + V·d.
# tiny:  d 256, L 4, 4 heads, 2 kv heads (hd 64), f 768, V 256, T 128
#   attn 131072 + 65536 = 196608; mlp 589824; N = 4·786432 + 65536 = 3211264
#   6N = 19267584; 12·4·256·128 = 1572864; total 20840448
# small: d 768, L 12, 12 heads = 12 kv heads, f 2048, V 50304, T 1024
#   attn 4·768² = 2359296; mlp 4718592; N = 12·7077888 + 38633472 = 123568128
#   6N = 741408768; 12·12·768·1024 = 113246208; total 854654976
# tiny with 4 experts, top 2: mlp = 2·589824 + router 256·4 = 1180672; N = 4·1377280 + 65536 = 5574656
#   6N = 33447936; + 1572864 = 35020800
HAND = {"tiny": 20_840_448, "small": 854_654_976}


@pytest.mark.parametrize("preset", sorted(HAND))
def test_flops_per_token_of_the_presets(preset):
    assert flops_per_token(PRESETS[preset]) == HAND[preset]


def test_moe_counts_only_the_active_experts():
    dims = ModelSpec(preset="tiny", moe=MoESpec(experts=4, top_k=2)).resolved()
    assert flops_per_token(dims) == 35_020_800


@pytest.mark.parametrize("preset", ["tiny", "small", "1b", "7b"])
def test_dense_n_is_the_models_matmul_parameters(preset):
    """N is every parameter but the RMSNorm gains (the tied embedding once, as the output projection)."""
    d = PRESETS[preset]
    with torch.device("meta"):
        model = GPT(d)
    norms = (2 * d.n_layer + 1) * d.d_model
    attention = 12 * d.n_layer * d.d_model * d.seq_len
    assert flops_per_token(d) == 6 * (model.num_params() - norms) + attention


@pytest.mark.parametrize(
    ("name", "precision", "tflops"),
    [
        ("NVIDIA H100 80GB HBM3", "bf16", 989.4),
        ("NVIDIA H100 PCIe", "bf16", 756.5),
        ("NVIDIA H100 NVL", "fp32", 60.0),
        ("NVIDIA H200", "bf16", 989.4),
        ("NVIDIA A100-SXM4-80GB", "bf16", 312.0),
        ("NVIDIA L40S", "bf16", 362.1),
        ("NVIDIA L4", "fp16", 121.0),
        ("AMD Instinct MI300X", "bf16", 1307.4),
    ],
)
def test_peak_table_by_device_name_and_precision(name, precision, tflops):
    peak = table_peak(name, precision)
    assert peak is not None and peak.flops == pytest.approx(tflops * 1e12)


def test_override_then_table_then_measured():
    assert peak_flops("NVIDIA H100 80GB HBM3", "bf16", override_tflops=100.0) == Peak(
        1e14, "VIGIL_PEAK_TFLOPS"
    )
    assert peak_flops("NVIDIA H100 80GB HBM3", "bf16", override_tflops=None).source.startswith("table: H100")
    assert peak_flops("cpu", "fp32", override_tflops=None, measured_flops=5e10) == Peak(
        5e10, "measured matmul rate"
    )
    assert peak_flops("cpu", "fp32", override_tflops=None) is None
    assert table_peak("Tesla V100-SXM2-32GB", "bf16") is None  # no bf16 on a V100


def test_mfu():
    peak = Peak(1e12, "test")
    assert mfu(1000.0, 4e8, peak) == pytest.approx(0.4)
    assert mfu(1000.0, 4e8, None) is None
