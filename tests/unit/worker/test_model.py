import pytest
import torch

from vigil.spec import PRESETS, ModelDims, ModelSpec
from vigil_trainer.model import GPT, ffn_hidden


def expected_params(d: ModelDims) -> int:
    """Closed form: tied embedding + per layer (q, k, v, o, SwiGLU or experts + router, two norms) + final norm."""
    hd = d.d_model // d.n_head
    attn = 2 * d.d_model * d.n_head * hd + 2 * d.d_model * d.n_kv_head * hd
    mlp = 3 * d.d_model * ffn_hidden(d)
    if d.moe:
        mlp = d.moe.experts * mlp + d.d_model * d.moe.experts
    return d.vocab_size * d.d_model + d.n_layer * (attn + mlp + 2 * d.d_model) + d.d_model


# (preset, low, high): the size class each preset promises
CLASSES = [("tiny", 1e6, 10e6), ("small", 110e6, 135e6), ("1b", 0.9e9, 1.3e9), ("7b", 6.5e9, 7.5e9)]


@pytest.mark.parametrize(("preset", "low", "high"), CLASSES)
def test_preset_parameter_count(preset, low, high):
    dims = ModelSpec(preset=preset).resolved()
    with torch.device("meta"):  # no memory, no init cost: 7b builds in milliseconds
        model = GPT(dims)
    n = model.num_params()
    assert n == expected_params(dims)
    assert low <= n <= high, f"{preset}: {n / 1e6:.1f}M parameters"


def test_known_widths():
    assert ffn_hidden(PRESETS["tiny"]) == 768
    assert ffn_hidden(PRESETS["small"]) == 2048  # 8 d^2 per MLP, like GPT-2's 4x MLP
    assert ffn_hidden(PRESETS["1b"]) == 5632  # TinyLlama
    assert ffn_hidden(PRESETS["7b"]) == 14336  # Mistral-7B


def test_embeddings_are_tied():
    model = GPT(ModelSpec(preset="tiny", n_layer=1).resolved())
    assert model.lm_head.weight is model.embed.weight


def test_forward_shapes_and_loss():
    torch.manual_seed(0)
    dims = ModelSpec(preset="tiny", n_layer=2, seq_len=32).resolved()
    model = GPT(dims)
    idx = torch.randint(0, dims.vocab_size, (3, 32))
    assert model(idx).shape == (3, 32, dims.vocab_size)
    loss = model(idx[:, :-1], idx[:, 1:])
    # an untrained model predicts roughly uniformly: loss near ln(V)
    assert abs(loss.item() - torch.log(torch.tensor(dims.vocab_size)).item()) < 0.5


def test_attention_is_causal():
    torch.manual_seed(0)
    model = GPT(ModelSpec(preset="tiny", n_layer=2, seq_len=16).resolved()).eval()
    idx = torch.randint(0, 256, (1, 16))
    changed = idx.clone()
    changed[0, 10] = (idx[0, 10] + 1) % 256
    with torch.no_grad():
        a, b = model(idx), model(changed)
    assert torch.allclose(a[0, :10], b[0, :10], atol=1e-5)
    assert not torch.allclose(a[0, 10:], b[0, 10:], atol=1e-5)


def test_sequence_longer_than_model_is_refused():
    model = GPT(ModelSpec(preset="tiny", n_layer=1, seq_len=8).resolved())
    with pytest.raises(ValueError, match="seq_len"):
        model(torch.zeros(1, 9, dtype=torch.long))


def test_moe_model_trains_every_expert():
    torch.manual_seed(0)
    dims = ModelSpec(preset="tiny", n_layer=1, seq_len=16, moe={"experts": 4, "top_k": 2}).resolved()
    model = GPT(dims)
    assert model.num_params() == expected_params(dims)
    idx = torch.randint(0, 256, (4, 17))
    loss = model(idx[:, :-1], idx[:, 1:])
    loss.backward()
    router = model.blocks[0].mlp.router.weight.grad
    assert router is not None and torch.isfinite(router).all()
    assert all(e.down.weight.grad is not None for e in model.blocks[0].mlp.experts)


def test_a_few_steps_reduce_the_loss():
    torch.manual_seed(0)
    model = GPT(ModelSpec(preset="tiny", n_layer=1, seq_len=16).resolved())
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    idx = torch.randint(0, 256, (2, 17))
    losses = []
    for _ in range(10):
        loss = model(idx[:, :-1], idx[:, 1:])
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0] * 0.8
