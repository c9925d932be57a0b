"""Model FLOPs utilisation: FLOPs per token of this GPT, and the device's peak for its precision.

`flops_per_token(dims)` is PaLM's (appendix B) training count, 6N + 12·L·d·T: N the parameters of the
matmuls one token goes through (a mixture of experts: only the `top_k` experts it is routed to, plus the
router), the second term the attention scores and their weighting. The tied embedding counts once, as
the output projection, whose matmul costs 2·V·d per token forward; the lookup itself is free, and the
RMSNorm gains are no matmul. `peak_flops` finds the device's dense peak (no sparsity) for the precision
in one table keyed by the name the driver reports; `VIGIL_PEAK_TFLOPS` overrides it, and a CPU (not in
the table) gets a measured matmul rate, which the rank logs as measured. Pure, except `measure_peak`.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from vigil.spec import ModelDims
from vigil_trainer.model import ffn_hidden

# Dense peak TFLOP/s per device and precision, from the vendors' data sheets (fp32: without TF32, which
# PyTorch leaves off for matmuls by default). Matched in order against the device name as a substring,
# so the more specific name comes first ("H100 PCIe" before "H100", "L40S" before "L4").
PEAK_TFLOPS: tuple[tuple[str, dict[str, float]], ...] = (
    ("GH200", {"bf16": 989.4, "fp16": 989.4, "fp32": 67.0}),
    ("H200", {"bf16": 989.4, "fp16": 989.4, "fp32": 67.0}),
    ("H100 PCIe", {"bf16": 756.5, "fp16": 756.5, "fp32": 51.2}),
    ("H100 NVL", {"bf16": 835.5, "fp16": 835.5, "fp32": 60.0}),
    ("H100", {"bf16": 989.4, "fp16": 989.4, "fp32": 67.0}),  # SXM ("NVIDIA H100 80GB HBM3")
    ("B200", {"bf16": 2250.0, "fp16": 2250.0, "fp32": 80.0}),
    ("A100", {"bf16": 312.0, "fp16": 312.0, "fp32": 19.5}),
    ("L40S", {"bf16": 362.1, "fp16": 362.1, "fp32": 91.6}),
    ("L4", {"bf16": 121.0, "fp16": 121.0, "fp32": 30.3}),
    ("A10", {"bf16": 125.0, "fp16": 125.0, "fp32": 31.2}),
    ("V100", {"fp16": 125.0, "fp32": 15.7}),
    ("MI300X", {"bf16": 1307.4, "fp16": 1307.4, "fp32": 163.4}),
    ("MI250X", {"bf16": 383.0, "fp16": 383.0, "fp32": 95.7}),
)


def flops_per_token(dims: ModelDims) -> float:
    """Training FLOPs (forward and backward) per token: 6N + 12·L·d·T, N the active matmul parameters."""
    d, hd = dims.d_model, dims.d_model // dims.n_head
    attn = 2 * d * dims.n_head * hd + 2 * d * dims.n_kv_head * hd  # q and o; k and v (grouped)
    mlp = 3 * d * ffn_hidden(dims)  # SwiGLU: gate, up, down
    if dims.moe:
        mlp = dims.moe.top_k * mlp + d * dims.moe.experts  # the experts a token is routed to, and the router
    n_active = dims.n_layer * (attn + mlp) + dims.vocab_size * d  # + the (tied) output projection
    return float(6 * n_active + 12 * dims.n_layer * d * dims.seq_len)


@dataclass(frozen=True)
class Peak:
    """A device's peak FLOP/s for one precision, and where the figure comes from."""

    flops: float
    source: str  # "table: H100", "VIGIL_PEAK_TFLOPS", "measured"


def table_peak(device_name: str, precision: str) -> Peak | None:
    """The table's peak for `device_name` at `precision` (bf16, fp16, fp32); None when not in the table."""
    for pattern, peaks in PEAK_TFLOPS:
        if pattern.lower() in device_name.lower() and precision in peaks:
            return Peak(peaks[precision] * 1e12, f"table: {pattern} {precision}")
    return None


def peak_flops(
    device_name: str, precision: str, *, override_tflops: float | None, measured_flops: float | None = None
) -> Peak | None:
    """The peak MFU is taken against: the override, else the table, else a measured rate (a CPU)."""
    if override_tflops is not None:
        return Peak(override_tflops * 1e12, "VIGIL_PEAK_TFLOPS")
    if (found := table_peak(device_name, precision)) is not None:
        return found
    return Peak(measured_flops, "measured matmul rate") if measured_flops else None


def mfu(tokens_per_s: float, flops_per_tok: float, peak: Peak | None) -> float | None:
    """Achieved model FLOP/s over the peak; None without a peak."""
    if peak is None or peak.flops <= 0:
        return None
    return tokens_per_s * flops_per_tok / peak.flops


def measure_peak(
    device: torch.device, dtype: torch.dtype = torch.float32, n: int = 512, reps: int = 8
) -> float:
    """FLOP/s of a square matmul on `device`: the best of `reps` timed runs after one warm-up (the rate
    this process's threads reach on this CPU, the honest denominator where no data sheet applies)."""
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    a @ b  # warm-up
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        a @ b
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        best = min(best, time.perf_counter() - t0)
    return 2 * n**3 / best
