"""On a GPU: the trainer's model compiled (inductor) under bf16 autocast, as `train.compile: auto` and
bf16 without ZeRO run it, gives the eager step's loss and gradients, and a second call builds no graph."""

import pytest
import torch

from vigil.spec import parse_spec
from vigil_trainer.compile import compiled_graphs
from vigil_trainer.model import GPT


@pytest.mark.gpu
def test_compiled_bf16_autocast_step_matches_eager_on_the_gpu():
    dims = parse_spec("name: x\nmodel: {preset: tiny}\n").model.resolved()
    torch.manual_seed(0)
    eager = GPT(dims).cuda()
    compiled = GPT(dims).cuda()
    compiled.load_state_dict(eager.state_dict())
    compiled.compile()
    x = torch.randint(0, dims.vocab_size, (8, dims.seq_len), device="cuda")
    y = torch.randint(0, dims.vocab_size, (8, dims.seq_len), device="cuda")
    losses = []
    for model in (eager, compiled):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = model(x, y)
        loss.backward()
        losses.append(loss.item())
    before = compiled_graphs()
    with torch.autocast("cuda", dtype=torch.bfloat16):
        compiled(x, y).backward()
    assert compiled_graphs() == before  # the same shapes: no recompile
    # bf16 matmuls: fused kernels round differently, within bf16's 3 significant digits
    assert losses[1] == pytest.approx(losses[0], rel=1e-2)
    ge, gc = eager.lm_head.weight.grad, compiled.lm_head.weight.grad
    assert torch.isfinite(gc).all()
    assert torch.nn.functional.cosine_similarity(ge.flatten(), gc.flatten() / 2, dim=0) > 0.99  # 2 backwards
