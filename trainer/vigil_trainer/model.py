"""A GPT decoder in readable PyTorch, in nanoGPT's spirit.

RoPE positions, grouped-query attention through `scaled_dot_product_attention` (flash kernels on
GPU), RMSNorm, SwiGLU MLPs (or a top-k routed mixture of SwiGLU experts when `dims.moe` is set),
tied input/output embeddings, no biases.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from vigil.spec import ModelDims

MOE_AUX_WEIGHT = 0.01  # weight of the router's load-balancing loss


def ffn_hidden(dims: ModelDims) -> int:
    """SwiGLU width: `dims.ffn_hidden` if set, else Llama's rule (8/3 d, rounded up to a multiple of 256)."""
    if dims.ffn_hidden:
        return dims.ffn_hidden
    hidden = int(2 * (4 * dims.d_model) / 3)
    return 256 * math.ceil(hidden / 256)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-5) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # normalise in fp32 for stability under bf16/fp16, return in the input's dtype
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return xf.type_as(x) * self.weight


def rope_tables(seq_len: int, head_dim: int, base: float = 10_000.0) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin tables, each (T, head_dim / 2)."""
    inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    angles = torch.outer(torch.arange(seq_len, dtype=torch.float32), inv_freq)  # (T, hd/2)
    return angles.cos(), angles.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate channel pairs of x (B, H, T, hd) by position-dependent angles."""
    x1, x2 = x.float()[..., 0::2], x.float()[..., 1::2]  # (B, H, T, hd/2) each
    out = torch.stack((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1)  # (B, H, T, hd/2, 2)
    return out.flatten(-2).type_as(x)


class Attention(nn.Module):
    def __init__(self, dims: ModelDims) -> None:
        super().__init__()
        self.n_head, self.n_kv_head = dims.n_head, dims.n_kv_head
        self.head_dim = dims.d_model // dims.n_head
        self.q = nn.Linear(dims.d_model, dims.n_head * self.head_dim, bias=False)
        self.k = nn.Linear(dims.d_model, dims.n_kv_head * self.head_dim, bias=False)
        self.v = nn.Linear(dims.d_model, dims.n_kv_head * self.head_dim, bias=False)
        self.o = nn.Linear(dims.n_head * self.head_dim, dims.d_model, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        B, T, _ = x.shape
        q = self.q(x).view(B, T, self.n_head, self.head_dim).transpose(1, 2)  # (B, H, T, hd)
        k = self.k(x).view(B, T, self.n_kv_head, self.head_dim).transpose(1, 2)  # (B, KV, T, hd)
        v = self.v(x).view(B, T, self.n_kv_head, self.head_dim).transpose(1, 2)  # (B, KV, T, hd)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if self.n_kv_head != self.n_head:  # grouped-query: each KV head serves n_head / n_kv_head queries
            k = k.repeat_interleave(self.n_head // self.n_kv_head, dim=1)  # (B, H, T, hd)
            v = v.repeat_interleave(self.n_head // self.n_kv_head, dim=1)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # (B, H, T, hd)
        return self.o(y.transpose(1, 2).reshape(B, T, -1))  # (B, T, C)


class SwiGLU(nn.Module):
    def __init__(self, d_model: int, hidden: int) -> None:
        super().__init__()
        self.gate = nn.Linear(d_model, hidden, bias=False)
        self.up = nn.Linear(d_model, hidden, bias=False)
        self.down = nn.Linear(hidden, d_model, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.silu(self.gate(x)) * self.up(x))


class MoE(nn.Module):
    """Top-k routed SwiGLU experts with a Switch-style load-balancing loss (kept in `self.aux_loss`).

    Every expert runs on the tokens routed to it (a loop over experts: readable, not the fastest).
    """

    def __init__(self, dims: ModelDims) -> None:
        super().__init__()
        assert dims.moe is not None
        self.top_k, self.n_experts = dims.moe.top_k, dims.moe.experts
        self.router = nn.Linear(dims.d_model, self.n_experts, bias=False)
        self.experts = nn.ModuleList(SwiGLU(dims.d_model, ffn_hidden(dims)) for _ in range(self.n_experts))
        self.aux_loss = torch.zeros(())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        flat = x.reshape(-1, C)  # (N, C)
        probs = F.softmax(self.router(flat).float(), dim=-1)  # (N, E)
        weights, chosen = probs.topk(self.top_k, dim=-1)  # (N, k)
        weights = (weights / weights.sum(-1, keepdim=True)).type_as(x)
        out = torch.zeros_like(flat)
        for e, expert in enumerate(self.experts):
            token, slot = (chosen == e).nonzero(as_tuple=True)
            # every expert runs (maybe on zero tokens) so that all parameters receive a gradient
            out.index_add_(0, token, expert(flat[token]) * weights[token, slot, None])
        # fraction of routing slots each expert got x mean router probability, scaled so uniform = 1
        load = F.one_hot(chosen, self.n_experts).float().sum((0, 1)) / chosen.numel()  # (E,)
        self.aux_loss = self.n_experts * (load * probs.mean(0)).sum()
        return out.view(B, T, C)


class Block(nn.Module):
    def __init__(self, dims: ModelDims) -> None:
        super().__init__()
        self.attn_norm = RMSNorm(dims.d_model)
        self.attn = Attention(dims)
        self.mlp_norm = RMSNorm(dims.d_model)
        self.mlp: nn.Module = MoE(dims) if dims.moe else SwiGLU(dims.d_model, ffn_hidden(dims))

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x), cos, sin)
        return x + self.mlp(self.mlp_norm(x))


class GPT(nn.Module):
    def __init__(self, dims: ModelDims) -> None:
        super().__init__()
        self.dims = dims
        self.embed = nn.Embedding(dims.vocab_size, dims.d_model)
        self.blocks = nn.ModuleList(Block(dims) for _ in range(dims.n_layer))
        self.norm = RMSNorm(dims.d_model)
        self.lm_head = nn.Linear(dims.d_model, dims.vocab_size, bias=False)
        self.lm_head.weight = self.embed.weight  # tied embeddings (one Parameter, counted once)
        cos, sin = rope_tables(dims.seq_len, dims.d_model // dims.n_head)
        # buffers, not parameters: not trained, not saved (persistent=False), rebuilt on load
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        self.apply(self._init_weights)
        # GPT-2's scaled init of the projections that write into the residual stream
        for name, p in self.named_parameters():
            if name.endswith(("attn.o.weight", "down.weight")):
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * dims.n_layer))

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, nn.Linear | nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def num_params(self) -> int:
        return sum(p.numel() for p in self.parameters())

    def configure_optimizers(
        self, weight_decay: float, learning_rate: float, betas: tuple[float, float]
    ) -> torch.optim.AdamW:
        """AdamW with nanoGPT's two groups: every parameter of two or more dimensions (matmul weights,
        the tied embedding) decays; the rest (norm gains, and biases were there any) does not. DeepSpeed
        steps it in every ZeRO stage; a dropped update gates its `step()` (`vigil.integrations.gate`)."""
        decay = [p for p in self.parameters() if p.dim() >= 2]
        no_decay = [p for p in self.parameters() if p.dim() < 2]
        groups = [
            {"params": decay, "weight_decay": weight_decay},
            {"params": no_decay, "weight_decay": 0.0},
        ]
        # fused: one kernel for the whole update (CUDA and CPU) rather than a loop over the tensors
        return torch.optim.AdamW(groups, lr=learning_rate, betas=betas, fused=True)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        """Token ids (B, T) -> logits (B, T, V), or the mean cross-entropy when `targets` (B, T) is given."""
        T = idx.shape[1]
        if self.dims.seq_len < T:
            raise ValueError(f"sequence length {T} exceeds model.seq_len ({self.dims.seq_len})")
        x = self.embed(idx)  # (B, T, C)
        cos, sin = self.rope_cos[:T], self.rope_sin[:T]
        for block in self.blocks:
            x = block(x, cos, sin)
        logits = self.lm_head(self.norm(x))  # (B, T, V)
        if targets is None:
            return logits
        loss = F.cross_entropy(logits.float().view(-1, logits.size(-1)), targets.reshape(-1))
        if self.dims.moe:
            loss = loss + MOE_AUX_WEIGHT * sum(b.mlp.aux_loss for b in self.blocks) / len(self.blocks)
        return loss
